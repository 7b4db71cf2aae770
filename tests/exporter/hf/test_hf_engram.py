"""DeepSeek V4.1's Engram keys in config.json: the recipe's model.engram, the weights
section's Engram roles, and what is refused by key."""

from __future__ import annotations

import copy

import pytest

from b12x_toolchain.exporter.hf.config import HfConfigError, recipe_from_hf_config
from b12x_toolchain.exporter.hf.config_engram import engram_section
from b12x_toolchain.exporter.hf.names import target_of
from b12x_toolchain.exporter.hf.quantization import weights_section
from b12x_toolchain.exporter.recipe.loader import load_recipe
from hf_reference import tiny_v4_config
from release_checkpoint import release_config

# The V4.1-Flash release's Engram keys: layers 1 and 14, orders 2..4 with 8 heads each, tables
# of 256 values per row, primes from 16,000,000, 99,092 compressed ids, pad 2.
RELEASE_ENGRAM = {
    "engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
    "engram_vocab_size": 16000000, "engram_compressed_vocab_size": 99092, "engram_pad_token_id": 2,
    "engram_num_embeddings": [384006168, 384016682],
}


@pytest.fixture(scope="module")
def v41_config():
    """config.json in V4.1's formats (32x32 blocks, expert_dtype inside quantization_config)."""
    return release_config(tiny_v4_config(), block=(32, 32), expert_dtype_inside=True)


def with_engram(config: dict, **changes) -> dict:
    return {**copy.deepcopy(config), **RELEASE_ENGRAM, **changes}


def test_release_engram_keys_give_model_engram(v41_config):
    assert engram_section(with_engram(v41_config)) == {
        "layer_ids": [1, 14], "max_ngram": 4, "heads_per_order": 8, "head_dim": 256,
        "prime_search_start": 16000000, "compressed_vocab_size": 99092, "pad_id": 2, "token_map": "tokenizer",
    }
    # engram_num_embeddings is a check, not a field: the rows follow from the primes.
    unstated = {k: v for k, v in with_engram(v41_config).items() if k != "engram_num_embeddings"}
    assert engram_section(unstated) == engram_section(with_engram(v41_config))


def test_release_engram_weights_roles(v41_config):
    weights = weights_section(with_engram(v41_config))
    assert weights["engram_tables"] == {"format": "fp8_e4m3", "block": [1, 32], "scale": "ue8m0"}
    assert weights["engram_projection"] == {"format": "fp8_e4m3", "block": [32, 32], "scale": "ue8m0"}
    assert weights["attention"] == weights["engram_projection"]


def test_wrong_row_count_is_refused(v41_config):
    config = with_engram(v41_config, engram_num_embeddings=[384006168, 384016683])
    with pytest.raises(HfConfigError, match=r"engram_num_embeddings\[1\]: layer 14's table has 384016683 rows; the sum "
                                            r"of its 24 primes from engram_vocab_size 16000000 is 384016682"):
        engram_section(config)
    with pytest.raises(HfConfigError, match=r"engram_num_embeddings: has 1 entries; engram_layer_ids names 2 layers"):
        engram_section(with_engram(v41_config, engram_num_embeddings=[384006168]))


@pytest.mark.parametrize("changes, message", [
    ({"engram_head_dim": None}, r"engram_head_dim: missing from config.json; the config has Engram keys"),
    ({"engram_head_dim": 100}, r"engram_head_dim: 100 is not a multiple of 32"),
    ({"engram_layer_ids": [14, 1]}, r"engram_layer_ids: \[14, 1\]; expected distinct layer ids in increasing order"),
    ({"engram_max_ngram_size": 1}, r"engram_max_ngram_size: 1 is less than 2"),
])
def test_malformed_engram_keys_refused(v41_config, changes, message):
    with pytest.raises(HfConfigError, match=message):
        engram_section(with_engram(v41_config, **changes))


def test_config_without_engram_gives_none(v41_config):
    assert engram_section(v41_config) is None
    assert not {"engram_tables", "engram_projection"} & set(weights_section(v41_config))
    doc = recipe_from_hf_config(v41_config, load_recipe("dsv4-tiny"), "x")
    assert "engram" not in doc["model"] and "engram_tables" not in doc["weights"]


def test_from_hf_does_not_drop_engram_layers(v41_config):
    # from-hf writes deepseek_v4 recipes; writing one without the config's Engram layers would
    # export another model, so it is refused.
    with pytest.raises(HfConfigError, match=r"engram_layer_ids: the config has Engram layers \[1, 14\]"):
        recipe_from_hf_config(with_engram(v41_config), load_recipe("dsv4-tiny"), "x")


@pytest.mark.parametrize("stored, ours", [
    ("layers.1.engram.embed.weight", "model.layers.1.engram.embed.weight"),
    ("layers.14.engram.wkv.weight", "model.layers.14.engram.wkv.weight"),  # not the attention's kv_proj
    ("layers.1.engram.q_weight", "model.layers.1.engram.q_weight"),
    ("model.layers.1.engram.k_weight", "model.layers.1.engram.k_weight"),
    ("layers.1.attn.wkv.weight", "model.layers.1.self_attn.kv_proj.weight"),
])
def test_release_engram_names(stored, ours):
    assert target_of(stored).name == ours
