"""Compiled replay: a pass graph lowered by TorchInductor on the local machine, on first use.

On the CPU a replay of a tiny pass costs what its graph nodes cost to dispatch one by one:
thousands of aten calls of a few microseconds each, most of them elementwise. Inductor
fuses those into a few generated C++ (CPU) or Triton (CUDA) kernels; the op set's ops stay
calls to their registered implementations, except `hc_sinkhorn`, which Inductor is given
as its written-out loop (`mhc_ops.sinkhorn_unfused`): small elementwise steps are what it
fuses best, and an opaque op would cost as much as uncompiled. The code is generated here, from the
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
import os
from pathlib import Path

import torch

from b12x_toolchain.runtime.ops.mhc_ops import sinkhorn_unfused
from b12x_toolchain.runtime.ops.opset import ops

CACHE_ENV = "B12X_COMPILE_CACHE"  # root of the local compile cache (default ~/.cache/b12x/compiled)
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"  # where Inductor reads and writes its caches


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "b12x" / "compiled")


def cache_dir(package, device, root: str | Path | None = None) -> Path:
    """The directory for one package on one device type with this torch."""
    digest = package.manifest["manifest_sha256"]  # the reader checked it covers every file
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

            with _inductor_cache(self.directory):
                self._compiled = compile_fx(self.graph, list(args), decompositions=_decompositions())
        return self._compiled(*args)


def _decompositions() -> dict:
    """Inductor's own table, plus hc_sinkhorn as the loop it fuses."""
    from torch._inductor.decomposition import select_decomp_table

    return {**select_decomp_table(), ops.hc_sinkhorn.default: sinkhorn_unfused}
