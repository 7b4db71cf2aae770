"""Compiled replay: a pass graph lowered by TorchInductor on the local machine, on first use.

On the CPU a replay of a tiny pass costs what its graph nodes cost to dispatch one by one:
thousands of aten calls of a few microseconds each, most of them elementwise. Inductor
fuses those into a few generated C++ (CPU) or Triton (CUDA) kernels. Before it does,
`lower_for_inductor` opens the op set's elementwise work to it: the ops that compute with
static shapes become their torch references (`hc_sinkhorn` its written-out loop), and
each encoding cache write becomes the encoding plus a byte copy; an opaque op would run
its reference step by step, as slow as uncompiled. The ops that scatter or select by data
stay calls to their registered implementations. The code is generated here, from the
package's graph, with this machine's compiler: nothing compiled is ever read from a
package.

A bucket's graph is compiled the first time it runs (a session binds every rows bucket of
every pass, most of which a server may never replay), for its fixed arguments: static
shapes, so one compilation per (pass, rows bucket). Inductor keeps what it generated in
a local cache directory keyed by the package's manifest digest, the device type and the
torch version, so a second process with the same package and torch reuses it and
another package or torch never sees it.

The result is not bitwise the uncompiled replay: fused reductions sum in another order,
so logits agree to float32 rounding (tests hold them within 1e-5 of the uncompiled
replay) and a cache value that rounds differently can land on a neighbouring code.
Passes that only move bytes (commit) are bitwise.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

import torch

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.ops import opset, sparse_ops
from b12x_toolchain.runtime.ops.mhc_ops import sinkhorn_unfused
from b12x_toolchain.runtime.ops.opset import RAW_BYTES, ops

CACHE_ENV = "B12X_COMPILE_CACHE"  # root of the local compile cache (default ~/.cache/b12x/compiled)
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"  # where Inductor reads and writes its caches


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "b12x" / "compiled")


def cache_dir(package, device, root: str | Path | None = None) -> Path:
    """The directory for one package on one device type with this torch."""
    digest = package.manifest.manifest_sha256  # the reader checked it covers every file
    torch_version = torch.__version__.replace("+", "_")
    return Path(root or cache_root()) / digest[:32] / f"{torch.device(device).type}-torch{torch_version}"


@contextlib.contextmanager
def _inductor_cache(directory: Path):
    """Point Inductor's on-disk caches at `directory` while it compiles (it reads the variable then)."""
    directory.mkdir(parents=True, exist_ok=True)
    before = os.environ.get(INDUCTOR_ENV)
    os.environ[INDUCTOR_ENV] = str(directory)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(INDUCTOR_ENV, None)
        else:
            os.environ[INDUCTOR_ENV] = before


INDUCTOR_CONFIG = {"reorder_for_locality": False}
"""A pass reads a cache's rows (the window history) before writing new ones over the ring.
Inductor's locality reordering would move that read past the write, and a cache read
after its write cannot be updated in place: Inductor would then clone the whole cache,
write the clone and copy it back on every replay, a cost of the cache's size rather than
the request's. Kept in graph order, every cache write happens in place."""


class CompiledGraph:
    """Callable like the pass graph; compiles itself with Inductor on the first call."""

    def __init__(self, graph: torch.fx.GraphModule, directory: Path):
        self.graph, self.directory = graph, directory
        self._compiled = None

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def __call__(self, *args):
        if self._compiled is None:
            from torch._inductor.compile_fx import compile_fx

            graph = copy.deepcopy(self.graph)  # buckets (and the uncompiled replay) share the package's graph
            lower_for_inductor(graph)
            with _inductor_cache(self.directory):
                # Inductor's own decompositions; graph order kept (see INDUCTOR_CONFIG).
                self._compiled = compile_fx(graph, list(args), config_patches=INDUCTOR_CONFIG)
        return self._compiled(*args)


WRITES = {ops.write_rows.default: (1, 5), ops.write_slots.default: (1, 3)}  # op -> (values, fmt) argument index
ALWAYS = lambda args: True  # noqa: E731
REFERENCES = {
    ops.round_trip.default: (opset.round_trip, ALWAYS),
    ops.gather_rows.default: (opset.gather_rows, ALWAYS),
    ops.window_read.default: (opset.window_read, ALWAYS),
    ops.read_rows.default: (opset.read_rows, ALWAYS),
    ops.hc_sinkhorn.default: (sinkhorn_unfused, ALWAYS),
    # Window only (no entry cache) or the indexer's listed ids: static shapes. Every visible
    # entry (no indices) is as many as the context holds, so that form stays the op.
    ops.sparse_attention.default: (sparse_ops.sparse_attention, lambda args: args[4] is None or args[8] is not None),
}
"""Ops that only compute from their inputs, with static shapes (where the condition on the
node's arguments holds): Inductor traces their torch references and fuses them
(hc_sinkhorn as its written-out loop)."""


def encode_rows(values: torch.Tensor, fmt: str) -> torch.Tensor:
    return get_format(fmt).encode(values)


def lower_for_inductor(graph: torch.fx.GraphModule) -> dict[str, int]:
    """Open the op set's elementwise work to Inductor; returns how many nodes each change took.

    On the CPU an opaque op runs its reference step by step: the codecs alone are dozens of
    small elementwise ops per call, which is what Inductor fuses best. So pure ops become
    calls of their references, and each cache write that encodes is split into the
    encoding, in the graph, and the op copying the encoded records (fmt "bytes"), which
    writes the same bytes. The ops that scatter or select by data stay themselves.
    """
    counts = {"references": 0, "split_writes": 0}
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in REFERENCES and REFERENCES[node.target][1](node.args):
            node.target = REFERENCES[node.target][0]
            counts["references"] += 1
        elif node.target in WRITES and node.args[WRITES[node.target][1]] != RAW_BYTES:
            values_at, fmt_at = WRITES[node.target]
            with graph.graph.inserting_before(node):
                encoded = graph.graph.call_function(encode_rows, (node.args[values_at], node.args[fmt_at]))
            args = list(node.args)
            args[values_at], args[fmt_at] = encoded, RAW_BYTES
            node.args = tuple(args)
            counts["split_writes"] += 1
    graph.recompile()
    return counts

