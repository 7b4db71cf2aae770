"""The `parallel` section of a recipe: how one model is split across ranks.

`tensor` splits attention heads (and the O groups with them), the vocabulary of the
embedding and the head, and the shared experts' intermediate dimension; `expert` gives
each rank whole routed experts. Both span the same ranks, as in vLLM without
data-parallel attention (EP = TP x DP with DP = 1): the world size is the larger of the
two, and each is either 1 or the world size. Without expert parallelism, tensor
parallelism splits every routed expert's intermediate dimension instead.
"""

from __future__ import annotations

from pydantic import model_validator

from b12x_toolchain.exporter.recipe.field_types import PosInt, _problem, _Spec


class ParallelSpec(_Spec):
    tensor: PosInt = 1
    expert: PosInt = 1

    @property
    def world_size(self) -> int:
        return max(self.tensor, self.expert)

    @model_validator(mode="after")
    def _one_world(self) -> ParallelSpec:
        for key in ("tensor", "expert"):
            value = getattr(self, key)
            if value not in (1, self.world_size):
                raise _problem(f"{value} is neither 1 nor the world size {self.world_size}; tensor and expert "
                               "parallelism span the same ranks", (key,))
        return self

    def check(self, model) -> None:
        """Refuse, at the `parallel` key that cannot hold, a split the model's dimensions do not allow."""
        t, e = self.tensor, self.expert
        divisions = [
            ("tensor", t, model.num_heads, "model.num_heads (heads are split whole)"),
            ("tensor", t, model.o_groups, "model.o_groups (each rank holds whole O groups)"),
            ("tensor", t, model.vocab_size, "model.vocab_size (vocab-parallel embedding and head)"),
        ]
        for where, moe in (("model.moe", model.moe), ("model.draft.moe", getattr(model.draft, "moe", None))):
            if moe is None:
                continue
            divisions.append(("expert", e, moe.experts, f"{where}.experts (each rank holds whole experts)"))
            if e == 1:
                divisions.append(("tensor", t, moe.intermediate_size,
                                  f"{where}.intermediate_size (routed experts split by intermediate dimension)"))
            if moe.shared_experts:
                divisions.append(("tensor", t, moe.intermediate_size,
                                  f"{where}.intermediate_size (shared experts split by intermediate dimension)"))
        for key, parts, size, what in divisions:
            if size % parts:
                raise _problem(f"{parts} does not divide {what} = {size}", ("parallel", key))
