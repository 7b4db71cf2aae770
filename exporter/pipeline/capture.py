"""Capture one pass with torch.export: weights, caches, staging and inputs as graph inputs.

The mutated caches and staging stay plain user inputs (custom ops keep their in-place
form before decomposition), so the graph's calling convention is exactly the buffer
list of the pass. "rows", "slots" and each page pool's page count are dynamic dimensions:
one graph serves every rows bucket, every session size and every page budget.

Weights may be fake tensors (structural export): the example buffers are then made in
the same fake mode, so nothing of full size is ever allocated. Stack traces are not
recorded: they hold the exporter's source paths and line numbers, which would make the
package bytes depend on where and from which revision the exporter runs.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.export import Dim

from b12x_toolchain.exporter.model.pass_modules import PassModule
from b12x_toolchain.exporter.pipeline.layer_copies import copying_layers
from b12x_toolchain.exporter.pipeline.stitch_layer_copies import stitch
from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.package.kinds import POOLS

# Not 0 or 1, so export does not specialise them.
EXAMPLE_SIZES = {"rows": 2, "slots": 3, **{pool: 3 for pool in POOLS}}
GROUPS = ("weight", "cache", "staging", "input")

FAKE_TENSOR_CACHE = False
"""Fake-tensor dispatch caches each op's output and rebuilds it on a hit, symbolic sizes and
strides included; with the dynamic rows, slots and page dimensions that rebuild costs more
than running the op's meta function again (a small recipe's export: 12% faster without the
cache). The graph is the same either way, byte for byte."""


def _dims() -> dict:
    pools = {pool: Dim(pool, min=1, max=1 << 30) for pool in POOLS}
    return {"rows": Dim("rows", min=1, max=1 << 16), "slots": Dim("slots", min=2, max=1 << 20), **pools}


def example_tensor(spec: BufferSpec, device) -> torch.Tensor:
    # Values never matter: export traces with fake tensors; only shape and dtype do.
    return torch.zeros(spec.resolve(EXAMPLE_SIZES), dtype=spec.torch_dtype, device=device)


def group_inputs(specs: list[BufferSpec]) -> tuple[dict, ...]:
    """Split the flat convention into the four dicts forward() takes, keeping order."""
    groups = {role: {} for role in GROUPS}
    for spec in specs:
        groups[spec.role][spec.name] = spec
    return tuple(groups[role] for role in GROUPS)


@contextmanager
def no_stack_traces():
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):  # torch before 2.13: traces are kept (slower)
        yield
        return
    saved = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = saved


def capture(module: PassModule, weights: dict[str, torch.Tensor], device="cpu",
            copy_layers: bool = True) -> torch.export.ExportedProgram:
    """The pass as an ExportedProgram. With `copy_layers`, each kind of target layer is traced
    once and copied for the others (layer_copies.py, stitch_layer_copies.py): the same graph in a fraction of the time."""
    inputs, _ = module.convention()
    dims = _dims()
    fake = detect_fake_mode(tuple(weights.values()))
    args, dynamic = [], []
    for group in group_inputs(inputs):
        values, shapes = {}, {}
        for name, spec in group.items():
            if spec.role == "weight":
                values[name] = weights[name]
            else:
                with fake or nullcontext():
                    values[name] = example_tensor(spec, device)
            shapes[name] = {i: dims[d] for i, d in enumerate(spec.shape) if isinstance(d, str)} or None
        args.append(values)
        dynamic.append(shapes)
    with torch.no_grad(), no_stack_traces(), copying_layers() as copies, \
            torch._dynamo.config.patch(fake_tensor_cache_enabled=FAKE_TENSOR_CACHE):
        module.copies = copies if copy_layers else None
        try:
            program = torch.export.export(module, tuple(args), dynamic_shapes=tuple(dynamic), strict=False)
        finally:
            module.copies = None
    stitch(program, module.name)
    # Sample inputs are pickled into the archive; a package carries none.
    program._example_inputs = None
    return program
