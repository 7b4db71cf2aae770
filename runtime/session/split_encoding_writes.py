"""split_encoding_writes: each cache write that encodes becomes the encoding plus a byte copy.

The codecs are dozens of small elementwise ops per call, which is what Inductor fuses
best, but inside the write op they run opaque. Split, the encoding is in the graph and
the write op copies the encoded records (fmt "bytes"), which stores the same bytes. The
write itself scatters by data and stays the op.
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.ops.opset import RAW_BYTES, ops
from b12x_toolchain.runtime.rewrite import NodeRewrite, Rule, replace_args


def encode_rows(values: torch.Tensor, fmt: str) -> torch.Tensor:
    return get_format(fmt).encode(values)


def encodes(args: dict) -> bool:
    return args["fmt"] != RAW_BYTES


def split(graph: torch.fx.Graph, write: torch.fx.Node, args: dict) -> None:
    with graph.inserting_before(write):
        encoded = graph.call_function(encode_rows, (args["values"], args["fmt"]))
    replace_args(write, values=encoded, fmt=RAW_BYTES)


SPLIT_ENCODING_WRITES = NodeRewrite("split_encoding_writes", (
    Rule(ops.write_rows.default, edit=split, when=encodes),
    Rule(ops.write_slots.default, edit=split, when=encodes),
))
