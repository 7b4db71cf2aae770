"""The `weights` section of a recipe: the storage format of each weight role, and the
activation rule of the quantized linears.

    weights:
      activation: deepseek          # none (default) | deepseek
      attention: {format: fp8_e4m3, block: [32, 32], scale: ue8m0}
      routed_experts: fp4_e2m1      # block [1, 32] and scale ue8m0 are the only ones it takes
      embeddings: bf16

A role left out is fp32; a recipe without the section is fp32 everywhere, and normalises
and hashes as it did before the section existed. Roles and the weights in each:
exporter/model/weight_roles.py. Formats and their scale grids: runtime/formats/weight_formats.py.
`activation: deepseek` quantizes activations to E4M3 per token per 128 channels with a
power-of-two scale before every FP8/FP4 linear, as DeepSeek's reference does; `none` leaves
them as they are (what transformers computes on CPU, and vLLM's W4A16 experts).
Whether a block fits each tensor and the `parallel` split is checked against the model
(exporter/model/weight_layout.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, model_validator

from b12x_toolchain.exporter.model.weight_roles import ROLE_BLOCKS, ROLE_ELEMENT_TYPES, ROLES
from b12x_toolchain.exporter.recipe.field_types import PosInt, _problem, _Spec
from b12x_toolchain.runtime.formats.weight_formats import (
    ELEMENT_TYPES,
    FP4_BLOCK,
    SCALE_ENCODINGS,
    WeightFormat,
    format_problem,
)

RECIPE_KEYS = {"kind": "format", "block": "block", "scale_encoding": "scale"}


def _shorthand(value):
    """`bf16` stands for `{format: bf16}`; fp4_e2m1 has one block and scale, so they may be left out."""
    if isinstance(value, str):
        value = {"format": value}
    if isinstance(value, dict) and value.get("format") == "fp4_e2m1":
        value = {"block": list(FP4_BLOCK), "scale": "ue8m0", **value}
    return value


class FormatSpec(_Spec):
    format: Literal[ELEMENT_TYPES]
    block: tuple[PosInt, PosInt] | None = None
    scale: Literal[SCALE_ENCODINGS] | None = None

    @model_validator(mode="after")
    def _combination(self) -> FormatSpec:
        problem = format_problem(self.format, self.block, self.scale)
        if problem:
            raise _problem(problem[1], (RECIPE_KEYS[problem[0]],))
        return self

    def weight_format(self) -> WeightFormat:
        return WeightFormat(self.format, self.block, self.scale)


Format = Annotated[FormatSpec, BeforeValidator(_shorthand)]
FP32 = FormatSpec(format="fp32")


class WeightsSpec(_Spec):
    activation: Literal["none", "deepseek"] = "none"
    attention: Format = FP32
    indexer_query: Format = FP32
    shared_experts: Format = FP32
    routed_experts: Format = FP32
    draft_input: Format = FP32
    head: Format = FP32
    embeddings: Format = FP32
    compressor: Format = FP32
    router: Format = FP32
    norms: Format = FP32
    draft_heads: Format = FP32
    engram_tables: Format = FP32
    engram_projection: Format = FP32

    def formats(self) -> dict[str, WeightFormat]:
        """role -> format, for every role."""
        return {role: getattr(self, role).weight_format() for role in ROLES}

    @model_validator(mode="after")
    def _roles_take_their_formats(self) -> WeightsSpec:
        for role, kinds in ROLE_ELEMENT_TYPES.items():
            kind = getattr(self, role).format
            if kind not in kinds:
                raise _problem(f"{kind} is not a format {role} takes ({', '.join(kinds)})", (role, "format"))
            block = getattr(self, role).block
            if block is not None and role in ROLE_BLOCKS and tuple(block) not in ROLE_BLOCKS[role]:
                shown = ", ".join(f"[{m}, {n}]" for m, n in ROLE_BLOCKS[role])
                raise _problem(f"{list(block)} is not a block {role} takes ({shown})", (role, "block"))
        if self.activation == "deepseek" and not any(f.quantized for f in self.formats().values()):
            raise _problem("deepseek quantizes activations before FP8/FP4 linears, and no role is fp8_e4m3 or "
                           "fp4_e2m1; use none", ("activation",))
        return self
