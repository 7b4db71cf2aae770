"""A tiny DeepSeek V4.1 checkpoint with Engram tensors under the release's names (tables FP8
with one F8_E8M0 scale per 32 values of a row, the projection in 32x32 blocks), imported
by `export --checkpoint`'s reader: the same bytes, and the same prefill logits, as the
weights given in b12x's layout; what is refused, by tensor or file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, models

from b12x_toolchain.exporter.hf.checkpoint import load_hf_checkpoint
from b12x_toolchain.exporter.model.engram import TOKEN_MAP, table_rows
from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.runtime.package.checkpoint import CheckpointError
from conftest import random_tokens
from exporter.model.test_v41_model import single_forward
from release_checkpoint import write_shards

FP8 = {"format": "fp8_e4m3", "scale": "ue8m0"}
RELEASE_FORMATS = {"weights": {"engram_tables": {**FP8, "block": [1, 32]},
                               "engram_projection": {**FP8, "block": [32, 32]}}}


@pytest.fixture(scope="module")
def recipe():
    return recipe_variant(load_recipe("dsv41-tiny"), RELEASE_FORMATS, name="dsv41-tiny-engram-fp8")


@pytest.fixture(scope="module")
def dims(recipe):
    return Dims.from_recipe(recipe)


@pytest.fixture(scope="module")
def weights(dims):
    return init_weights(dims, seed=4)


def release_name(name: str) -> str:
    """DeepSeek's name for an Engram tensor (`layers.1.engram.embed.scale`); b12x's for the rest."""
    if ".engram." not in name:
        return name
    name = name.removeprefix("model.")
    return name.removesuffix(".weight_scale") + ".scale" if name.endswith(".weight_scale") else name


def engram_config(dims) -> dict:
    e = dims.engram
    return {"engram_layer_ids": list(e.layer_ids), "engram_max_ngram_size": e.max_ngram, "engram_n_heads": e.heads,
            "engram_head_dim": e.head_dim, "engram_vocab_size": e.prime_start,
            "engram_compressed_vocab_size": e.compressed_vocab, "engram_pad_token_id": e.pad_id,
            "engram_num_embeddings": list(table_rows(dims).values()),
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}}


def write_checkpoint(root, tensors: dict, config: dict):
    root.mkdir(parents=True)
    write_shards(root, tensors)
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def release_tensors(weights):
    """The release's Engram names, the F8_E8M0 scales as stored; no token map (the recipe's is identity)."""
    tensors = {release_name(name): t for name, t in weights.items() if name != TOKEN_MAP}
    assert tensors["layers.1.engram.embed.scale"].dtype == torch.float8_e8m0fnu
    return tensors


@pytest.fixture(scope="module")
def checkpoint(release_tensors, dims, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("v41-engram") / "ckpt", release_tensors, engram_config(dims))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_release_names_import_as_b12x_weights_and_prefill_the_same(checkpoint, weights, dims, recipe):
    loaded = load_hf_checkpoint(checkpoint, dims)
    assert sorted(loaded) == sorted(weights)
    assert [n for n in weights if not same_bytes(loaded[n], weights[n])] == []
    # The prefill pass's module (what the package captures; an export would add ~20 s) on both.
    tokens = random_tokens(torch.Generator().manual_seed(6), 128)
    logits = single_forward(recipe, loaded, tokens)
    assert torch.equal(logits, single_forward(recipe, weights, tokens))
    # The tables take part: another table's rows give other logits.
    other = {**loaded, "model.layers.1.engram.embed.weight": loaded["model.layers.1.engram.embed.weight"].flip(0)}
    assert not torch.equal(logits, single_forward(recipe, other, tokens))


def test_a_table_with_other_rows_is_refused(release_tensors, dims, tmp_path):
    rows = table_rows(dims)[3]
    data, scale = release_tensors["layers.3.engram.embed.weight"], release_tensors["layers.3.engram.embed.scale"]
    wrong = {**release_tensors, "layers.3.engram.embed.weight": torch.cat([data, data[:1]]),
             "layers.3.engram.embed.scale": torch.cat([scale, scale[:1]])}
    root = write_checkpoint(tmp_path / "ckpt", wrong, engram_config(dims))
    with pytest.raises(CheckpointError, match=rf"^layers\.3\.engram\.embed\.weight: the Engram table has {rows + 1} rows; "
                                              rf"layer 3's 6 primes from 500 sum to {rows}, so {rows} rows are expected$"):
        load_hf_checkpoint(root, dims)


def test_config_engram_keys_must_be_the_recipes(release_tensors, dims, tmp_path):
    root = write_checkpoint(tmp_path / "pad", release_tensors, {**engram_config(dims), "engram_pad_token_id": 3})
    with pytest.raises(CheckpointError, match=r"^config\.json: engram_pad_token_id gives model\.engram\.pad_id = 3, but "
                                              r"the recipe's is 2$"):
        load_hf_checkpoint(root, dims)
    plain = {k: v for k, v in engram_config(dims).items() if not k.startswith("engram_")}
    root = write_checkpoint(tmp_path / "none", release_tensors, plain)
    with pytest.raises(CheckpointError, match=r"^config\.json: has no Engram keys .*, but the recipe has Engram layers "
                                              r"\[1, 3\]$"):
        load_hf_checkpoint(root, dims)


def word_tokenizer(path, vocab: int, distinct: int):
    """A word-level tokenizer of `vocab` ids whose last ones are upper-case copies of the first:
    `distinct` keys."""
    words = [f"w{i}" for i in range(distinct)] + [f"W{i}" for i in range(vocab - distinct)]
    Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0")).save(str(path))


def test_token_map_from_tokenizer_json(checkpoint, recipe, tmp_path):
    dims = Dims.from_recipe(recipe_variant(recipe, {"model.engram.token_map": "tokenizer"}))
    root = shutil.copytree(checkpoint, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=rf"^tokenizer\.json: not in the checkpoint, and it holds no {TOKEN_MAP}; "
                                              r"the recipe's engram token_map is 'tokenizer'"):
        load_hf_checkpoint(root, dims)
    e = dims.engram
    word_tokenizer(root / "tokenizer.json", dims.vocab, e.compressed_vocab)
    got = load_hf_checkpoint(root, dims)[TOKEN_MAP]
    assert got.tolist() == [*range(e.compressed_vocab), *range(dims.vocab - e.compressed_vocab)]


def test_a_stored_token_map_is_used_and_checked(release_tensors, dims, tmp_path):
    shuffled = torch.arange(dims.vocab) * 7 % dims.engram.compressed_vocab  # 7 is prime to 384: onto every id
    root = write_checkpoint(tmp_path / "ok", {**release_tensors, TOKEN_MAP: shuffled}, engram_config(dims))
    assert torch.equal(load_hf_checkpoint(root, dims)[TOKEN_MAP], shuffled)
    bad = shuffled.clone()
    bad[5] = dims.engram.compressed_vocab
    root = write_checkpoint(tmp_path / "bad", {**release_tensors, TOKEN_MAP: bad}, engram_config(dims))
    with pytest.raises(CheckpointError, match=rf"^{TOKEN_MAP}: token 5 maps to 384; expected 0 <= id < "
                                              r"compressed_vocab_size 384$"):
        load_hf_checkpoint(root, dims)
