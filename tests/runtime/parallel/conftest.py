"""The packages of the serving-across-ranks tests: the small recipe with float32 caches (so
two ranks' logits agree with one device's to 1e-5) at the shipped tokenizer's vocabulary
(so chat has a template and text a tokenizer), for one device and over two ranks."""

from __future__ import annotations

import pytest

from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from conftest import SMALL, once_per_run
from decode_steps import FP32_CACHES

# The shipped tokenizer's vocabulary and its distinct normalised keys (Engram's compressed ids).
SHIPPED_VOCAB = {"model.vocab_size": 2048, "model.engram.compressed_vocab_size": 1432}
MAPPINGS = {"tensor2": {"tensor": 2}, "tensor2-expert2": {"tensor": 2, "expert": 2}}


@pytest.fixture(scope="session")
def chat_recipe(tiny_recipe):
    return recipe_variant(tiny_recipe, {**SMALL, **FP32_CACHES, **SHIPPED_VOCAB}, name="dsv41-chat")


@pytest.fixture(scope="session")
def shipped_tokenizer(chat_recipe):
    from b12x_toolchain.exporter.hf.tokenizer_files import checkpoint_tokenizer
    from b12x_toolchain.exporter.recipe.dims import Dims
    from paths import SHIPPED_CHECKPOINT

    return checkpoint_tokenizer(SHIPPED_CHECKPOINT, Dims.from_recipe(chat_recipe).vocab)


@pytest.fixture(scope="session")
def chat_path(chat_recipe, shipped_tokenizer, run_dir):
    """One device, the recipe's own weights."""
    return once_per_run(run_dir, "chat", lambda out: export_package(chat_recipe, out, tokenizer=shipped_tokenizer).path)


@pytest.fixture(scope="session")
def chat_parallel_path(chat_recipe, shipped_tokenizer, run_dir):
    """chat_parallel_path(mapping id): the recipe over two ranks with that mapping, the same
    weights (exported by the first test that asks, once per run)."""
    def path(mapping: str):
        recipe = recipe_variant(chat_recipe, {"parallel": MAPPINGS[mapping]}, name=f"dsv41-chat-{mapping}")
        return once_per_run(run_dir, f"chat-{mapping}",
                            lambda out: export_package(recipe, out, tokenizer=shipped_tokenizer).path)

    return path
