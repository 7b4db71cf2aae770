"""The model's linears over stored formats (exporter/model/linears.py), against float32
products of the exactly decoded weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from b12x_toolchain.exporter.model.linears import Linears
from b12x_toolchain.exporter.model.weights import SCALE_SUFFIX, init_weights
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.runtime.formats.weight_formats import decode_fp4, decode_fp8_block

M = "model.layers.1.mlp."
O_A = "model.layers.0.self_attn.o_a_proj.weight"


def scheme(block: int) -> dict:
    return {"routed_experts": "fp4_e2m1",
            "attention": {"format": "fp8_e4m3", "block": [block, block], "scale": "ue8m0"}}


@pytest.fixture(scope="module")
def model():
    """(Dims, Linears, weights) of dsv41-tiny with FP4 experts and 32x32 FP8 attention."""
    d = Dims.from_recipe(recipe_variant(load_recipe("dsv41-tiny"), {"weights": scheme(32)}, name="q"))
    return d, Linears(d), init_weights(d, seed=1)


def _swiglu(gate, up):
    return F.silu(gate) * up


def test_routed_experts_are_the_chosen_experts_decoded(model):
    d, linear, w = model
    gen = torch.Generator().manual_seed(0)
    R, T, E, K = 2, 3, d.moe.experts, d.moe.experts_per_token
    x = torch.randn(R, T, d.hidden, generator=gen)
    chosen = torch.rand(R, T, E, generator=gen).argsort(dim=-1)[..., :K]
    picked = torch.rand(R, T, K, generator=gen)
    got = linear.routed(w, M, x, chosen, picked, None, _swiglu)
    gate_up = decode_fp4(w[M + "experts.gate_up_proj"], w[M + "experts.gate_up_proj" + SCALE_SUFFIX])
    down = decode_fp4(w[M + "experts.down_proj"], w[M + "experts.down_proj" + SCALE_SUFFIX])
    want = torch.zeros_like(x)
    for r in range(R):
        for t in range(T):
            for k in range(K):
                e = int(chosen[r, t, k])
                h = _swiglu(*F.linear(x[r, t], gate_up[e]).chunk(2))
                want[r, t] += picked[r, t, k] * F.linear(h, down[e])
    assert (got - want).abs().max() < 1e-5
    # Under expert parallelism each rank holds a slice of the experts; the ranks' sum is the whole.
    half = E // 2
    parts = []
    for rank in range(2):
        local = slice(rank * half, (rank + 1) * half)
        shard = {name: t[local] if name.startswith(M + "experts.") else t for name, t in w.items()}
        parts.append(linear.routed(shard, M, x, chosen, picked, local, _swiglu))
    assert (parts[0] + parts[1] - got).abs().max() < 1e-5


@pytest.mark.parametrize("block", [32, 128])
def test_grouped_output_projection_is_per_group_over_the_decoded_weight(block):
    """o_a_proj's groups either hold whole scale blocks (32) or share one block (128 > the
    rows of a group); both decode as the whole weight does."""
    d = Dims.from_recipe(recipe_variant(load_recipe("dsv41-tiny"), {"weights": scheme(block)}, name="q"))
    linear, w = Linears(d), init_weights(d, seed=2)
    fmt = linear.formats[O_A]
    groups = d.o_groups
    weight = decode_fp8_block(w[O_A], w[O_A + SCALE_SUFFIX], fmt.block)
    x = torch.randn(2, 3, groups, weight.shape[1], generator=torch.Generator().manual_seed(1))
    want = torch.einsum("rtgi,goi->rtgo", x, weight.view(groups, -1, weight.shape[1]))
    assert (linear.grouped(w, O_A, x) - want).abs().max() < 1e-5


def test_a_group_that_starts_inside_a_block_and_runs_into_the_next_is_refused(model):
    _, linear, w = model
    x = torch.zeros(1, 1, 3, w[O_A].shape[1])  # three groups of the rows: the second starts mid-block
    rows = w[O_A].shape[0] // 3 * 3
    cut = {O_A: w[O_A][:rows], O_A + SCALE_SUFFIX: w[O_A + SCALE_SUFFIX][: -(-rows // 32)]}
    with pytest.raises(ValueError, match="start inside a 32-row scale block and run into the next"):
        linear.grouped(cut, O_A, x)
