"""Structural export: capture every pass without weights, for CI machines that have none.

Weights are fake tensors (FakeTensorMode: dtype and shape over meta storage, no bytes),
so the full-size recipe captures in well under a GiB. They report the CPU device rather
than "meta" because a graph records the device it was traced on (`arange(device=...)`,
`_assert_tensor_metadata`): a structural package must hold the very graphs a capture with
real weights gives, byte for byte, and run once its weights are bound. Each pass gets its
own fake mode, as each real capture gets its own, so symbol numbering matches too.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from b12x_toolchain.exporter.model.parallel import engram_tables, rank_weight_specs
from b12x_toolchain.exporter.model.weights import weight_formats, weight_specs
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.package.manifest import Weights, WeightTensor


def fake_weights(d: Dims) -> dict[str, torch.Tensor]:
    """Fresh shape-only weights for one capture."""
    with FakeTensorMode(shape_env=ShapeEnv()):
        return {name: torch.empty(shape, dtype=getattr(torch, dtype))
                for name, (shape, dtype) in rank_weight_specs(d).items()}


def external_weights(d: Dims, checksums: dict[str, str] | None = None) -> Weights:
    """The manifest's `weights` entry of a structural package: what a checkpoint must hold (whole
    tensors; a parallel package's ranks cut their shards out by `parallel.splits`)."""
    checksums = checksums or {}
    tensors = {name: WeightTensor(dtype, tuple(shape), checksums.get(name))
               for name, (shape, dtype) in weight_specs(d).items()}
    return Weights("external: bound from a checkpoint at load time", external=True, tensors=tensors,
                   formats=weight_formats(d), activation=d.activation, engram_tables=engram_tables(d))
