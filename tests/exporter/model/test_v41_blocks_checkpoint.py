"""A tiny checkpoint in DeepSeek V4.1's release formats (FP8 32x32 UE8M0, FP4 experts, the
expert dtype inside `quantization_config`), imported as stored and decoded.

transformers has no V4.1 model and no V4.1 names exist outside DeepSeek's release, so the
checkpoint is the V4 architecture (two layers: CSA, HCA) in V4.1's formats: what changes between the two releases'
weights is the block grid and where the config declares the expert dtype, and both are
read here. transformers loads it as well (it decodes the weights exactly to float32 and runs
plain float32 linears: activation rule `none`), so the logits are checked against it, of a
prefill and token by token.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from b12x_toolchain.exporter.hf.checkpoint import load_hf_checkpoint
from b12x_toolchain.exporter.recipe.dims import Dims
from conftest import random_tokens
from decode_steps import FP32_CACHES, exported, incremental, prefill
from exporter.model.test_quantized_weights import TOLERANCE, assert_speculation_equals_greedy, release_scheme
from hf_reference import reference_logits, small_v4_config, small_v4_recipe, tiny_weights
from release_checkpoint import write_release_checkpoint
from release_package import NO_DECODE

pytestmark = pytest.mark.slow(minutes=0.7)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41-blocks") / "ckpt"
    write_release_checkpoint(root, small_v4_config(), tiny_weights(seed=5, small=True), block=(32, 32),
                             expert_dtype_inside=True)
    return root


@pytest.fixture(scope="module")
def package(checkpoint, tmp_path_factory):
    # Without the optional decode pass (a fifth of the tracing): greedy decoding then verifies one
    # token a step, and the speculative test compares drafts against that. V4's decode pass keeps
    # its exactness test in test_v4_fidelity (quantised caches, speculation equals greedy).
    recipe = small_v4_recipe({**FP32_CACHES, **NO_DECODE, "weights": release_scheme(32, "none")},
                             name="dsv4-small-v41-blocks")
    weights = load_hf_checkpoint(checkpoint, Dims.from_recipe(recipe))
    return exported(recipe, weights, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def test_imported_as_stored_and_prefill_matches_transformers(package, reference):
    formats = {f.describe() for f in package.manifest.weights.formats.values()}
    assert formats == {"fp8_e4m3 32x32 ue8m0", "fp4_e2m1 1x32 ue8m0", "bf16"}
    tokens = random_tokens(torch.Generator().manual_seed(3), 100)
    got = prefill(package.session(slots=1, max_rows=1), 0, tokens)
    err = (got - reference_logits(reference, tokens)).abs().max().item()
    print(f"prefill {len(tokens)} tokens: max |Δlogit| {err:.3g}")
    assert err < TOLERANCE


def test_incremental_logits_match_transformers(package, reference):
    gen = torch.Generator().manual_seed(21)
    sequences = [random_tokens(gen, 120), random_tokens(gen, 120)]
    for slot, (ours, seq) in enumerate(zip(incremental(package, sequences, [40, 57]), sequences)):
        n = ours.shape[0]
        err = (ours - reference_logits(reference, seq)[:n]).abs().max().item()
        print(f"request {slot}: {n} positions, max |Δlogit| {err:.3g}")
        assert n >= 90 and err < TOLERANCE  # past the window (32) and several HCA groups (16)


def test_speculative_decoding_equals_greedy(package):
    assert_speculation_equals_greedy(package, seed=8)
