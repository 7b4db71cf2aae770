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
another package or torch never sees it. Both of torch's caches answer there, Inductor's
graph cache and AOTAutograd's (`_static_fakes`, `marked_cacheable`): a later
compilation of the same graph reads the generated code back without tracing it again, in
seconds (a pass graph of the one-layer test recipe: 3 s against about a minute of CPU).

The result is not bitwise the uncompiled replay: fused reductions sum in another order,
so logits agree to float32 rounding (tests hold them within 1e-5 of the uncompiled
replay) and a cache value that rounds differently can land on a neighbouring code.
Passes that only move bytes (commit) are bitwise. Among compiled passes a token's numbers
do not depend on the pass (decode = verify's first row, to the bit): attention stays the op
(reference_ops.py says why), and the rest is row-wise work over axes of fixed length.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from b12x_toolchain.runtime.rewrite import RewriteResult

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


def _static_fakes(args) -> tuple[object, list]:
    """(the tracing context to compile in, `args` as fake tensors of static shape).

    Inductor looks its compiled graphs up in its on-disk cache only when the tracing context's
    fake mode has a shape environment (a graph compiled outside torch.compile has none unless
    given one); with it, a process after the first reads the generated code instead of
    generating and building it again. Given real tensors, that fake mode would make every
    dimension symbolic (dynamic-shape kernels); fakes of static shape made here keep each
    bucket's shapes fixed, as its kernels and their reduction order are meant to be."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fakes = [fake_mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]
    return tracing(TracingContext(fake_mode)), fakes


def marked_cacheable(graph: torch.fx.GraphModule) -> dict[str, str]:
    """The project's functions the lowered graph calls (the op references), each marked safe for
    torch's compile caches, keyed by a digest of the runtime's source: a cached graph that
    inlined a reference is read back only while that code is unchanged. Unmarked, torch would
    trace the graph again on every compile rather than trust its caches with a function it
    does not know."""
    return {f"{n.target.__module__}.{n.target.__qualname__}": runtime_digest() for n in graph.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__module__", "").startswith("b12x_toolchain.")}


@functools.cache
def runtime_digest() -> str:
    root = Path(__file__).resolve().parents[1]  # runtime/
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


INDUCTOR_CONFIG = {"reorder_for_locality": False}
"""A pass reads a cache's rows (the window history) before writing new ones over the ring.
Inductor's locality reordering would move that read past the write, and a cache read
after its write cannot be updated in place: Inductor would then clone the whole cache,
write the clone and copy it back on every replay, a cost of the cache's size rather than
the request's. Kept in graph order, every cache write happens in place."""

CPU_CONFIG = {"cpp_wrapper": True}
"""On CPU, the graph's wrapper is C++ too, and its kernels are defined in the wrapper's source:
one compiler run per graph rather than one per kernel (a one-layer decode graph: 35 runs of
the compiler, 86 s of CPU, against 59 s), and no Python between kernels at each replay."""


class CompiledGraph:
    """Callable like the pass graph; compiles itself with Inductor on the first call."""

    def __init__(self, graph: torch.fx.GraphModule, directory: Path):
        self.graph, self.directory = graph, directory
        self._compiled = None

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def compile(self, args) -> None:
        """Compile for `args` (the bucket's fixed arguments: only their shapes and dtypes are read)."""
        if self._compiled is not None:
            return
        from torch._inductor.compile_fx import compile_fx

        graph = copy.deepcopy(self.graph)  # buckets (and the uncompiled replay) share the package's graph
        cpu = all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))
        lower_for_inductor(graph, cpu=cpu)
        context, fakes = _static_fakes(args)
        with _inductor_cache(self.directory), context:
            # Inductor's own decompositions; graph order kept (see INDUCTOR_CONFIG).
            patches = {**INDUCTOR_CONFIG, "unsafe_marked_cacheable_functions": marked_cacheable(graph)}
            if cpu:
                patches.update(CPU_CONFIG)
            self._compiled = compile_fx(graph, fakes, config_patches=patches)

    def __call__(self, *args):
        if self._compiled is None:
            self.compile(args)
        return self._compiled(*args)


def lower_for_inductor(graph: torch.fx.GraphModule, cpu: bool = False) -> list[RewriteResult]:
    """Open the op set's elementwise work to Inductor: pure ops become calls of their
    references (reference_ops.py) and each cache write that encodes becomes the encoding plus
    a byte copy (split_encoding_writes.py). The ops that scatter or select by data stay
    themselves; for the CPU's C++ wrapper, called with their strings as integers
    (code_string_arguments.py). Returns each rewrite's result."""
    # Imported here: the rewrite kit imports networkx, which a session that compiles nothing
    # would otherwise import before its first token.
    from b12x_toolchain.runtime.rewrite import run_rewrites
    from b12x_toolchain.runtime.session.reference_ops import INLINE_REFERENCES
    from b12x_toolchain.runtime.session.split_encoding_writes import SPLIT_ENCODING_WRITES

    rewrites = [INLINE_REFERENCES, SPLIT_ENCODING_WRITES]
    if cpu:
        from b12x_toolchain.runtime.session.code_string_arguments import CODE_STRING_ARGUMENTS

        rewrites.append(CODE_STRING_ARGUMENTS)
    return run_rewrites(graph, rewrites, "compiled replay")
