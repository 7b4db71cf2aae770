"""Whether the recipe's weight formats fit the model's tensors and its `parallel` split.

A block need not divide a tensor: the scale grid is a ceiling grid, a partial block zero
padded, as DeepSeek's checkpoints store it (runtime/formats/weight_formats.py). Three things must hold:
- fp4_e2m1 packs two values a byte and scales whole groups of 32: the input dimension is a
  multiple of 32;
- a routed expert's gate_up holds gate then up; a block must not straddle the two, so each
  half's rows are whole blocks (each is its own tensor, with its own grid, in a checkpoint);
- each rank's shard starts and ends on block boundaries along the split axis, so a rank's
  data and its scales are cut out of the whole ones by the same split (parallel.py).
Each refusal names the weight, and points at the role's line (`weights.ROLE.block`) or at
the `parallel` key whose split cuts a block.
"""

from __future__ import annotations

from b12x_toolchain.exporter.model.parallel import split_of
from b12x_toolchain.exporter.model.weights import logical_specs, weight_roles
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.field_types import _problem


def check_weight_layout(recipe) -> None:
    """Raise a located recipe problem for the first weight whose format does not fit."""
    d = Dims.from_recipe(recipe)
    specs = logical_specs(d)
    for name, weight in sorted(weight_roles(d).items()):
        fmt = weight.format
        if not fmt.quantized:
            continue
        shape = specs[name][0]
        problem = fmt.shape_problem(shape)
        if problem:
            raise _problem(f"{name}: {problem}", ("weights", weight.role, "format"))
        rows = shape[-2] // weight.parts
        if weight.gate_up and rows % fmt.block[0]:
            raise _problem(f"{fmt.block[0]}x{fmt.block[1]} blocks straddle gate and up of {name}: each half has "
                           f"{rows} rows, not a multiple of {fmt.block[0]}", ("weights", weight.role, "block"))
        _check_split(d, name, shape, fmt)


def _check_split(d: Dims, name: str, shape, fmt) -> None:
    split = split_of(name, d)
    if split is None or split.axis < len(shape) - 2:  # whole experts per rank: no block is cut
        return
    block = fmt.block[split.axis - len(shape) + 2]
    piece = shape[split.axis] // (2 * split.parts if split.halves else split.parts)
    if piece % block:  # only tensor parallelism cuts inside the last two axes
        axis = "rows" if split.axis == len(shape) - 2 else "columns"
        raise _problem(f"{split.parts} ranks cut {name} ({fmt.describe()}) into {piece} {axis} a rank, not a "
                       f"multiple of the block's {block}; a rank's shard must start and end on block boundaries",
                       ("parallel", "tensor"))
