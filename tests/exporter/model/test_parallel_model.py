"""Tensor and expert parallel DeepSeek V4.1 (and V4) on gloo, in real processes: world size 2 gives
the logits of world size 1.

Each rank runs the eager prefill module over a whole sequence (every layer kind, hash and
routed MoE, the vocab-parallel embedding and head) with its shards of the same weights,
then a draft (DSpark; V4: MTP) over the caches that prefill wrote; the logits must equal one
device's within 1e-5 (fp32 caches).
"""

from __future__ import annotations

import pytest
import torch

import paging
from b12x_toolchain.exporter.model.parallel import rank_weights
from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from conftest import random_tokens
from decode_steps import FP32_CACHES
from ranks import on_ranks

pytestmark = pytest.mark.slow(minutes=0.5)

LENGTH = 150  # past the 128-token window


def forward(d: Dims, weights, tokens, rank=0):
    """Prefill over all of `tokens` at once, then a draft from the position after: both logits."""
    n = len(tokens)
    prefill, draft = PASSES["prefill"](d, rank), PASSES["draft"](d, rank)
    inputs, _ = prefill.convention()
    draft_inputs, _ = draft.convention()
    symbols = paging.symbols(inputs, 2)
    caches = {s.name: torch.zeros(s.resolve(symbols), dtype=s.torch_dtype) for s in prefill.caches()}
    one = torch.tensor([0], dtype=torch.int32)
    staging = {s.name: torch.zeros(s.resolve({**symbols, "rows": 1}), dtype=s.torch_dtype)
               for s in draft_inputs if s.role == "staging"}
    with torch.no_grad():
        out = prefill(weights, caches, {}, {"tokens": torch.tensor([tokens], dtype=torch.int32), "row_ids": one,
                                            "positions": one * 0, "lengths": one * n,
                                            **paging.block_tables(inputs, one)})
        block = torch.tensor([[tokens[-1]] + [d.noise_token_id] * (d.draft_width - 1)], dtype=torch.int32)
        drafted = draft(weights, caches, staging, {"tokens": block, "row_ids": one, "positions": one * n,
                                                    **paging.block_tables(draft_inputs, one)})
    return out["logits"][0], drafted["logits"][0]


def _rank_forward(rank, recipe, tokens):
    d = Dims.from_recipe(recipe)
    whole = init_weights(Dims.from_recipe(recipe), seed=recipe.model.init_seed)
    return forward(d, rank_weights(whole, d, rank), tokens, rank)


def base(recipe, weights=None):
    # History and chunk hold every position, so one prefill call covers the sequence.
    # Weights fp32 unless the case names formats (None drops dsv4-tiny's V4 Instruct formats,
    # whose 128x128 blocks no tensor split of its toy widths keeps whole).
    changes = {**FP32_CACHES, "cache.history": LENGTH + 8, "passes.prefill.chunk": LENGTH, "rewrites": [],
               "weights": weights}
    return recipe_variant(recipe, changes, name="parallel-base")


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(torch.Generator().manual_seed(5), LENGTH)


@pytest.fixture(scope="module")
def one_device(tokens):
    """Per recipe: the one-device logits, computed once."""
    cache = {}

    def get(name, recipe):
        if name not in cache:
            d = Dims.from_recipe(recipe)
            cache[name] = forward(d, init_weights(d, seed=recipe.model.init_seed), tokens)
        return cache[name]
    return get


CASES = {"v41-tensor2": ("dsv41-tiny", {"tensor": 2}), "v41-expert2": ("dsv41-tiny", {"expert": 2}),
         "v41-tensor2-expert2": ("dsv41-tiny", {"tensor": 2, "expert": 2}),
         "v4-tensor2-expert2": ("dsv4-tiny", {"tensor": 2, "expert": 2})}  # V4: CSA / HCA layers, MTP drafts
# V4.1's release formats: FP8 32x32 shards cut on block boundaries, FP4 experts whole per rank.
V41_RELEASE = {"routed_experts": "fp4_e2m1", "embeddings": "bf16", "head": "bf16", "norms": "bf16",
               **{role: {"format": "fp8_e4m3", "block": [32, 32], "scale": "ue8m0"}
                  for role in ("attention", "indexer_query", "shared_experts", "draft_input")}}
QUANTIZED = {"v41-release-formats-tensor2-expert2": ("dsv41-tiny", {"tensor": 2, "expert": 2}, V41_RELEASE)}


ALL = {**{case: (*spec, None) for case, spec in CASES.items()}, **QUANTIZED}


def _recipes(name, mapping, weights):
    """(the one-device recipe, the same over two ranks with `mapping`)."""
    reference = base(load_recipe(name), weights)
    return reference, recipe_variant(reference, {"parallel": mapping}, name="parallel")


def _rank_cases(rank, cases, tokens):
    """Every case on this rank, in one process per rank (a spawned process costs seconds of
    imports): case -> logits, or the error it raised, so that each case fails alone."""
    out = {}
    for case, recipe in cases.items():
        try:
            out[case] = _rank_forward(rank, recipe, tokens)
        except Exception as error:  # noqa: BLE001 - reported by that case's test
            out[case] = f"{type(error).__name__}: {error}"
    return out


@pytest.fixture(scope="module")
def two_ranks(tokens):
    """Per rank: case -> (prefill logits, draft logits) at world size 2."""
    return on_ranks(_rank_cases, 2, {case: _recipes(*spec)[1] for case, spec in ALL.items()}, tokens)


@pytest.mark.parametrize("case", list(ALL))
def test_world_size_2_equals_world_size_1(case, two_ranks, one_device):
    name, mapping, weights = ALL[case]
    expected = one_device(name if weights is None else f"{name} quantized", _recipes(name, mapping, weights)[0])
    for rank, per_case in enumerate(two_ranks):
        logits = per_case[case]
        assert not isinstance(logits, str), f"rank {rank}: {logits}"
        for what, ours, ref in zip(("prefill", "draft"), logits, expected):
            err = (ours - ref).abs().max().item()
            print(f"{name} {mapping} rank {rank} {what}: max |Δlogit| {err:.3g}")
            assert err < 1e-5, (mapping, rank, what, err)
