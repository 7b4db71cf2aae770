"""Parallel packages on gloo, world size 2, in real processes: every rank loads its graphs and
shards from one package, and serving gives what one device gives.

The tiny V4.1 recipe with fp32 caches, tensor 2 and expert 2 over the two ranks, is
exported once for both ranks (captured on torch's fake backend). The mappings on one axis
only (tensor 2; expert 2) are held to one device's logits by test_parallel_model, layer
by layer; this end-to-end check costs a minute a mapping, so it runs the one that shards
both. Each rank then runs
prefill and verify/commit steps teacher-forced (logits within 1e-5 of one device's),
plain greedy decoding, speculative decoding and seeded sampling through the serving
engine; every rank samples on its own from the same logits, so the ranks' tokens must be
identical, and equal to one device's.
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from b12x_toolchain.runtime.serving.speculative import Decoder
from conftest import random_tokens
from decode_steps import incremental
from ranks import on_ranks

pytestmark = [pytest.mark.slow(minutes=1.5), pytest.mark.usefixtures("one_torch_thread")]  # two rank processes

# Teacher-forced: > 40 positions past both prompts, and past the 128-row window ring's first wrap.
LENGTH, PROMPTS = 176, [40, 77]
NEW_TOKENS = 12
MAPPINGS = {"tensor2-expert2": {"tensor": 2, "expert": 2}}


@pytest.fixture(scope="module")
def weights(fp32_recipe):
    return init_weights(Dims.from_recipe(fp32_recipe), seed=fp32_recipe.model.init_seed)


@pytest.fixture(scope="module")
def workload():
    gen = torch.Generator().manual_seed(19)
    sequences = [random_tokens(gen, LENGTH) for _ in PROMPTS]
    return sequences, [seq[:n] for seq, n in zip(sequences, PROMPTS)]


def serve(package, workload):
    """Everything one rank (or one device) computes: teacher-forced logits, then tokens."""
    sequences, prompts = workload
    logits = incremental(package, sequences, PROMPTS)
    greedy = Decoder(package.session(slots=2, max_rows=2)).generate(prompts, NEW_TOKENS, speculative=False)
    speculative = Decoder(package.session(slots=2, max_rows=2)).generate(prompts, NEW_TOKENS, speculative=True)
    engine = Engine(package.session(slots=2, max_rows=2), speculative=True, temperature=0.8, seed=7)
    sampled = [s.tokens for s in engine.generate([Request(p, max_new_tokens=NEW_TOKENS) for p in prompts])]
    return {"logits": logits, "greedy": greedy, "speculative": speculative, "sampled": sampled}


def _serve_rank(rank, path, workload):
    return serve(load(path, rank=rank, peer_timeout=60), workload)


@pytest.fixture(scope="module")
def one_device(fp32_path, workload):
    return serve(load(fp32_path), workload)  # exported with the recipe's own weights, as `weights` are


@pytest.mark.parametrize("mapping", MAPPINGS.values(), ids=MAPPINGS.keys())
def test_two_ranks_serve_as_one_device(fp32_recipe, weights, workload, one_device, mapping, tmp_path_factory):
    recipe = recipe_variant(fp32_recipe, {"parallel": mapping}, name="dsv41-tiny-parallel")
    path = export_package(recipe, tmp_path_factory.mktemp("parallel"), weights=weights).path
    ranks = on_ranks(_serve_rank, 2, str(path), workload)
    for rank, got in enumerate(ranks):
        for slot, (ours, ref) in enumerate(zip(got["logits"], one_device["logits"])):
            assert ours.shape == ref.shape and ours.shape[0] >= PROMPTS[slot] + 40
            err = (ours - ref).abs().max().item()
            print(f"{mapping} rank {rank} request {slot}: {ours.shape[0]} positions, max |Δlogit| {err:.3g}")
            assert err < 1e-5, (mapping, rank, slot, err)
        for what in ("greedy", "speculative", "sampled"):
            assert got[what] == ranks[0][what], (what, rank)  # every rank sampled the same tokens
            assert got[what] == one_device[what], what
        assert got["speculative"] == got["greedy"]
