"""Single-layer window graphs shared by the pass tests, and their structural comparison."""

from __future__ import annotations

import torch

import b12x_toolchain.runtime.ops.opset  # noqa: F401  (registers the b12x op set)
from b12x_toolchain.runtime.formats.layout import staging_shape

ops = torch.ops.b12x_toolchain

ROWS, SLOTS, WIDTH, DIM = 2, 3, 8, 64
ROW_BYTES = 66  # one dsv41_mxfp8 row of 64 dims: 64 element bytes + 2 scale bytes
HISTORY = 128  # the only history length the fused op is qualified for
LAYOUT, PAGE = "NHD", 16
FMT = "dsv41_mxfp8"
TOKENS = HISTORY + WIDTH


def ring(history=HISTORY) -> torch.Tensor:
    return torch.zeros(SLOTS, history, ROW_BYTES, dtype=torch.uint8)


def staging(history=HISTORY, layout=LAYOUT, page_size=PAGE) -> torch.Tensor:
    return torch.zeros(staging_shape(ROWS, history + WIDTH, ROW_BYTES, layout, page_size), dtype=torch.uint8)


def kv() -> torch.Tensor:
    return torch.zeros(ROWS, WIDTH, DIM)


def row_input() -> torch.Tensor:
    return torch.zeros(ROWS, dtype=torch.int32)


def layer_inputs(history=HISTORY, layout=LAYOUT, page_size=PAGE) -> tuple:
    """(ring, staging, kv, row_ids, positions) for one layer."""
    return ring(history), staging(history, layout, page_size), kv(), row_input(), row_input()


def export(module: torch.nn.Module, *args) -> torch.fx.GraphModule:
    return torch.export.export(module, args, strict=False).graph_module


def structure(gm: torch.fx.GraphModule) -> list:
    """Every node as (op, target, args), argument nodes replaced by their position.

    Two graphs with the same structure compute the same thing whatever their nodes are
    called; placeholders keep their names because they are the calling convention.
    """
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    rows = []
    for n in gm.graph.nodes:
        args = torch.fx.node.map_arg(n.args, lambda a: ("node", index[a]))
        target = n.target if n.op == "placeholder" else str(n.target)
        rows.append((n.op, target, args))
    return rows
