"""The shard plan: which weights each rank holds, as data, and that the shards are the model."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.exporter.model.parallel import rank_weight_specs, rank_weights, split_of, weight_bytes
from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from decode_steps import FP32_WEIGHTS

MAPPINGS = [{"tensor": 2}, {"expert": 2}, {"tensor": 2, "expert": 2}]


@pytest.mark.parametrize("mapping", MAPPINGS, ids=["tensor2", "expert2", "tensor2-expert2"])
def test_the_ranks_shards_put_back_together_are_the_whole_model(tiny_recipe, mapping):
    d = Dims.from_recipe(recipe_variant(tiny_recipe, {"parallel": mapping}))
    whole = init_weights(d, seed=0)
    shards = [rank_weights(whole, d, rank) for rank in range(2)]
    specs = rank_weight_specs(d)
    for name, tensor in whole.items():
        split = split_of(name, d)
        for shard in shards:
            assert tuple(shard[name].shape) == specs[name][0], name
        if split is None:
            assert all(shard[name] is tensor for shard in shards), name
            continue
        if split.ranges is not None:  # an Engram table: each rank's range, then zero padding rows
            pieces = [shard[name][: stop - start] for shard, (start, stop) in zip(shards, split.ranges)]
            assert all(not shard[name][stop - start :].any() for shard, (start, stop) in zip(shards, split.ranges))
            assert torch.equal(torch.cat(pieces), tensor), name
            continue
        halves = [s[name].chunk(2, dim=split.axis) if split.halves else (s[name],) for s in shards]
        rebuilt = torch.cat([torch.cat([h[i] for h in halves], dim=split.axis) for i in range(len(halves[0]))],
                            dim=split.axis)
        assert torch.equal(rebuilt, tensor), name


def test_what_is_split_follows_the_mapping(tiny_recipe):
    def split(mapping, name):
        return split_of(name, Dims.from_recipe(recipe_variant(tiny_recipe, {"parallel": mapping})))

    q, experts = "model.layers.1.self_attn.q_b_proj.weight", "model.layers.1.mlp.experts.gate_up_proj"
    indexer = "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight"
    assert split({"tensor": 2}, q).axis == 0 and split({"expert": 2}, q) is None
    assert (split({"tensor": 2}, experts).axis, split({"tensor": 2}, experts).halves) == (1, True)
    assert split({"expert": 2}, experts).axis == 0 and split({"tensor": 2, "expert": 2}, experts).axis == 0
    assert split({"tensor": 2}, indexer) is None  # the indexer is replicated: every rank ranks the same entries


@pytest.mark.parametrize("weights", ["fp32", "release"])
def test_full_size_at_eight_ranks_splits_within_a_rounding_of_the_ideal(weights):
    recipe = load_recipe("dsv41")  # in the V4.1 release's formats; FP32_WEIGHTS drops them
    changes = {"parallel": {"tensor": 8, "expert": 8}, **(FP32_WEIGHTS if weights == "fp32" else {})}
    d = Dims.from_recipe(recipe_variant(recipe, changes))
    sizes = weight_bytes(d)
    assert abs(sizes["sharded_per_rank"] / sizes["sharded_ideal"] - 1) < 0.05
    whole = sizes["sharded_ideal"] * 8 + sizes["replicated"]
    assert sizes["per_rank"] < 1.05 * whole / 8 + sizes["replicated"]
    assert sizes["replicated"] < 0.01 * whole  # norms, mHC, latent projections, routers, the indexer
    assert not any(name.endswith(("experts.gate_up_proj", "lm_head.weight")) for name in sizes["replicated_names"])
