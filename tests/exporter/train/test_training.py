"""Training runs the exported model's own layers: the same logits as the prefill pass, a step
that lowers the loss, the indexer trained by distillation, the drafter by its block loss, and
a checkpoint the release reader takes back byte for byte."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.exporter.hf.checkpoint import load_hf_checkpoint
from b12x_toolchain.exporter.model.engram import TOKEN_MAP
from b12x_toolchain.exporter.model.engram_token_map import identity_token_map
from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.model.weights import SCALE_SUFFIX, init_weights, logical_specs, weight_specs
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.exporter.train import drafter, language_model
from b12x_toolchain.exporter.train.checkpoint_writer import (
    release_tensors,
    scale_name,
    stored_name,
    write_release_checkpoint,
)
from b12x_toolchain.exporter.train.pipeline import float_recipe
from b12x_toolchain.exporter.train.tokenizer import save_tokenizer, train_tokenizer
from b12x_toolchain.exporter.train.training_ops import IndexerDistillation

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LENGTH = 32
INDEXER = "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"  # the small recipe's ratio-2 Full layer


@pytest.fixture(scope="module")
def dims(small_recipe):
    return Dims.from_recipe(small_recipe)


@pytest.fixture()
def weights(dims):
    return init_weights(dims, seed=3)


@pytest.fixture(scope="module")
def tokens(dims):
    return torch.randint(0, dims.vocab, (2, LENGTH), generator=torch.Generator().manual_seed(5))


def prefill_logits(recipe, weights, tokens):
    """The prefill pass's module over each row from position 0, on real (quantized) caches."""
    import paging

    rows, n = tokens.shape
    module = PASSES["prefill"](Dims.from_recipe(recipe_variant(recipe, {"passes.prefill.chunk": n})))
    inputs, _ = module.convention()
    caches = {s.name: torch.zeros(s.resolve(paging.symbols(inputs, rows)), dtype=s.torch_dtype) for s in module.caches()}
    row_ids = torch.arange(rows, dtype=torch.int32)
    with torch.no_grad():
        out = module(weights, caches, {}, {"tokens": tokens.int(), "row_ids": row_ids, "positions": row_ids * 0,
                                           "lengths": row_ids * 0 + n, **paging.block_tables(inputs, row_ids)})
    return out["logits"]


def test_the_training_forward_is_the_prefill_pass(small_recipe, dims, weights, tokens):
    with torch.no_grad():
        logits, _ = language_model.forward_sequences(PASSES["prefill"](dims), weights, tokens)
    assert torch.equal(logits, prefill_logits(small_recipe, weights, tokens))


def loss_of(module, weights, tokens, distillation=None):
    """The next-token loss (a tensor that takes gradients)."""
    logits, _ = language_model.forward_sequences(module, weights, tokens, distillation)
    return language_model.next_token_loss(logits, tokens)


def test_one_step_lowers_the_loss_on_a_tiny_batch(dims, weights, tokens):
    module = PASSES["prefill"](dims)
    params = language_model.trainable(weights, [n for n in weights if n not in drafter.drafter_weight_names(weights)])
    before = float(loss_of(module, weights, tokens).detach())
    language_model.optimise(params, language_model.Schedule(1, 1e-2, warmup=1), lambda step: loss_of(module, weights, tokens))
    assert float(loss_of(module, weights, tokens).detach()) < before - 0.01


def test_the_indexer_learns_from_the_distillation_alone(dims, weights, tokens):
    module = PASSES["prefill"](dims)
    language_model.trainable(weights, [INDEXER, "lm_head.weight"])
    loss_of(module, weights, tokens).backward()
    assert weights[INDEXER].grad is None and weights["lm_head.weight"].grad is not None  # top-k has no gradient
    distillation = IndexerDistillation()
    loss_of(module, weights, tokens, distillation)
    assert len(distillation.losses) == 1  # one Full layer with an indexer
    distillation.losses[0].backward()
    assert weights[INDEXER].grad.abs().sum() > 0


def test_a_drafter_step_lowers_its_block_loss(dims, weights, tokens):
    module = PASSES["prefill"](dims)
    data = drafter.draft_data(module, weights, tokens)
    assert torch.equal(data.labels, language_model.forward_sequences(module, weights, tokens)[0].argmax(-1))
    seqs, anchors = drafter.sample_anchors(data, 2, 4, dims.draft_width, torch.Generator().manual_seed(0))
    params = language_model.trainable(weights, drafter.drafter_weight_names(weights))
    before = float(drafter.draft_loss(module, weights, data, seqs, anchors)[0].detach())
    language_model.optimise(params, language_model.Schedule(1, 1e-2, warmup=1),
                            lambda step: drafter.draft_loss(module, weights, data, seqs, anchors)[0])
    assert float(drafter.draft_loss(module, weights, data, seqs, anchors)[0].detach()) < before - 0.01
    assert not any(n.startswith("model.") for n in drafter.drafter_weight_names(weights))  # the target stays


def test_the_checkpoint_reads_back_in_its_formats(tmp_path):
    recipe = load_recipe("dsv41-mini")
    d = Dims.from_recipe(recipe)
    weights = init_weights(Dims.from_recipe(float_recipe(recipe.normalized())), seed=1)
    weights[TOKEN_MAP] = identity_token_map(d.vocab, d.engram.compressed_vocab)
    save_tokenizer(train_tokenizer(["def f(x):\n    return x\n"], vocab_size=300), tmp_path / "tokenizer")
    root = write_release_checkpoint(tmp_path / "ckpt", recipe, d, weights, tmp_path / "tokenizer", {"seed": 1})
    stored = release_tensors(d, weights)
    assert any(name.startswith("layers.1.engram.") for name in stored)  # DeepSeek's names for Engram's tensors
    assert {t.dtype for t in stored.values()} >= {torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu,
                                                 torch.bfloat16}
    loaded = load_hf_checkpoint(root, d)
    assert sorted(loaded) == sorted(weight_specs(d))
    for name in logical_specs(d):  # the bytes written, as the reader hands them to an export
        for ours, theirs in ((name, stored_name(name)), (name + SCALE_SUFFIX, scale_name(name))):
            if ours in loaded:
                a, b = loaded[ours], stored[theirs]
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), ours
    assert (root / "tokenizer.json").is_file() and (root / "training.json").is_file()
    with pytest.raises(ValueError, match="not empty"):
        write_release_checkpoint(root, recipe, d, weights, tmp_path / "tokenizer", {})
