"""DeepSeek V4.1 config.json -> a `deepseek_v41` recipe: CSA2, DSpark and Engram keys,
the V4.1-Flash values, what is refused by key, and `b12x recipe from-hf` on such a config."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.hf.config import HfConfigError, is_v41, model_fields, recipe_from_hf_config
from b12x_toolchain.exporter.hf.config_writer import v41_config_dict
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_from_dict, recipe_variant

# The keys V4.1 adds to V4's config.json (CSA2, DSpark), and its Engram keys.
V41_ADDS = {"kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks",
            "candidate_block_size", "dspark_block_size", "dspark_target_layer_ids", "dspark_noise_token_id",
            "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok"}
ENGRAM = {"engram_layer_ids", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
          "engram_compressed_vocab_size", "engram_pad_token_id", "engram_num_embeddings"}
# DeepSeek V4.1 Instruct's quantization_config: FP8 in 32x32 blocks with UE8M0 scales, FP4 experts.
V41_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
             "weight_block_size": [32, 32], "expert_dtype": "fp4"}


def v41_config(recipe, block_size: int | None = None) -> dict:
    """config.json as a DeepSeek V4.1 checkpoint would state `recipe`'s model."""
    return v41_config_dict(recipe, block_size)


@pytest.fixture(scope="module")
def tiny():
    return load_recipe("dsv41-tiny")


@pytest.fixture()
def config(tiny):
    return v41_config(tiny)


def from_hf(config, template=None, name="dsv41-tiny", **kw):
    doc = recipe_from_hf_config(config, template, name, **kw)
    return recipe_from_dict(doc)


def test_the_tiny_config_states_every_v41_key(config):
    assert V41_ADDS | ENGRAM <= set(config)
    assert is_v41(config) and is_v41({"model_type": "deepseek_v4", "dspark_markov_rank": 16})
    assert not is_v41({"model_type": "deepseek_v4", "engram_layer_ids": [1]})


def test_from_hf_gives_the_bundled_v41_tiny_recipe(config, tiny):
    # Everything but the token map, which a release's config says comes from its tokenizer.
    expected = recipe_variant(tiny, {"model.engram.token_map": "tokenizer"})
    assert from_hf(config).normalized() == expected.normalized()  # dsv41-tiny is the V4.1 default template
    assert from_hf(config, tiny).normalized() == expected.normalized()


def test_each_field_names_its_config_key(config):
    _, sources = model_fields(config)
    assert sources["family"] == "model_type"
    assert sources["csa2.candidate_block_size"] == "candidate_block_size"
    assert sources["draft.stages"] == "num_nextn_predict_layers"
    assert sources["draft.moe.experts"] == "dspark_n_routed_experts"
    assert sources["draft.moe.intermediate_size"] == "moe_intermediate_size"  # the drafter has no key of its own
    # Without model_type deepseek_v41, the first V4.1 key is what makes it V4.1's.
    fields, sources = model_fields({**config, "model_type": "deepseek_v4"})
    assert fields["family"] == "deepseek_v41" and sources["family"] == "kv_source_layer_ids"


def test_dspark_block_size_is_the_draft_width(config, tiny):
    recipe = from_hf({**config, "dspark_block_size": 5}, tiny)
    assert (recipe.passes.draft.width, recipe.passes.verify.width) == (5, 6)
    assert recipe.rewrites[0].expect_matches["draft"] == tiny.model.draft.stages


def test_layer_types_give_the_same_ratios(config, tiny):
    kinds = {0: "sliding_attention", 2: "compressed_sparse_attention", 1: "heavily_compressed_attention"}
    typed = {**config, "layer_types": [kinds[r] for r in tiny.model.target_ratios],
             "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 1}}
    assert from_hf(typed).model.compress_ratios == tiny.model.compress_ratios
    del typed["compress_ratios"]
    assert from_hf(typed).model.compress_ratios == tiny.model.compress_ratios


def test_no_candidates_without_a_candidate_source(config):
    bare = {k: v for k, v in config.items() if not k.startswith("candidate_")}
    assert from_hf(bare).model.csa2.candidate_source_layer_id is None


def test_v41_flash_config_gives_the_bundled_v41_model():
    full = load_recipe("dsv41")
    config = {**v41_config(full, block_size=5), "quantization_config": V41_QUANT}
    # The release's Engram keys: 384,006,168 and 384,016,682 rows are the sums of each layer's primes.
    assert config["engram_num_embeddings"] == [384006168, 384016682]
    assert config["compress_ratios"] == [0, 0] + [2] * 18 + [1] * 20 + [0] * 3 and config["rms_norm_eps"] == 1e-20
    recipe = from_hf(config, full, "dsv41")
    assert recipe.normalized()["model"] == full.normalized()["model"]  # CSA2, DSpark and Engram included
    assert (recipe.passes.draft.width, recipe.passes.verify.width) == (5, 6)  # the released block, not dsv41's 7
    weights, bundled = recipe.normalized()["weights"], full.normalized()["weights"]
    assert {role: weights[role] for role in weights if role != "draft_heads"} == \
        {role: bundled[role] for role in weights if role != "draft_heads"}


@pytest.mark.parametrize("changes, message", [
    ({"kv_source_layer_ids": None}, r"^kv_source_layer_ids: missing from config.json"),
    ({"kv_source_layer_ids": [4, 2]}, r"^kv_source_layer_ids: \[4, 2\]; expected distinct layer ids in increasing"),
    ({"kv_source_layer_ids": [2, 6]}, r"^kv_source_layer_ids\[1\]: layer 6 is out of range; num_hidden_layers is 6"),
    ({"kv_source_layer_ids": [1, 4]}, r"^kv_source_layer_ids: layer 1 is window-only; a kv source must be a compressed"),
    ({"index_source_layer_ids": [2, 5]}, r"^index_source_layer_ids: kv source 4 is missing"),
    ({"index_source_layer_ids": "2,4"}, r"^index_source_layer_ids: '2,4' is not a list"),
    ({"candidate_source_layer_id": 3}, r"^candidate_source_layer_id: layer 3 is not an index source"),
    ({"candidate_topk_blocks": None}, r"^candidate_topk_blocks: missing from config.json \(candidate_source_layer_id"),
    ({"candidate_block_size": 0}, r"^candidate_block_size: 0 is less than 1"),
    ({"dspark_block_size": None}, r"^dspark_block_size: missing from config.json"),
    ({"dspark_block_size": True}, r"^dspark_block_size: True is not an integer"),
    ({"dspark_target_layer_ids": []}, r"^dspark_target_layer_ids: \[\]; expected distinct layer ids"),
    ({"dspark_noise_token_id": 512}, r"^dspark_noise_token_id: 512 is out of range; expected < vocab_size"),
    ({"dspark_markov_rank": 0}, r"^dspark_markov_rank: 0 is less than 1"),
    ({"dspark_n_routed_experts": None}, r"^dspark_n_routed_experts: missing from config.json"),
    ({"dspark_num_experts_per_tok": 5}, r"^dspark_num_experts_per_tok: 5 is more than experts = 4"),
    ({"num_nextn_predict_layers": 0}, r"^num_nextn_predict_layers: 0; the recipe needs DSpark draft stages"),
    ({"compress_ratios": [0, 0, 4, 4, 1, 1]}, r"^compress_ratios\[2\]: 4 is not one of 0, 1, 2"),
    ({"compress_ratios": [0, 0, 2, 2, 1, 1, 0, 1]}, r"^compress_ratios\[7\]: DSpark stage 1's entry is 1"),
    ({"compress_ratios": [0, 0, 2, 2, 1]}, r"^compress_ratios: has 5 entries; expected num_hidden_layers = 6"),
    ({"layer_types": ["sliding_attention"] * 2 + ["compressed_sparse_attention"] * 4,
      "compress_rates": {"compressed_sparse_attention": 2}}, r"^compress_ratios: \[0, 0, 2, 2, 1, 1\] disagrees with"),
    ({"layer_types": ["sliding_attention"] * 2 + ["compressed_sparse_attention"] * 4,
      "compress_rates": {"compressed_sparse_attention": 4}}, r"^compress_rates.compressed_sparse_attention: 4 is not"),
    ({"engram_layer_ids": [1, 6]}, r"^engram_layer_ids: layer 6 is out of range"),
    ({"engram_compressed_vocab_size": 1000}, r"^engram_compressed_vocab_size: 1000 is more than vocab_size"),
    ({"engram_num_embeddings": [1, 2]}, r"^engram_num_embeddings\[0\]: layer 1's table has 1 rows"),
    ({"model_type": "deepseek_v5"}, r"^model_type: 'deepseek_v5' is not 'deepseek_v4' or 'deepseek_v41'"),
])
def test_malformed_v41_keys_are_refused_by_name(config, changes, message):
    with pytest.raises(HfConfigError, match=message):
        recipe_from_hf_config({**config, **changes}, None, "x")


def test_the_template_must_be_a_v41_recipe(config):
    with pytest.raises(HfConfigError, match=r"^model_type: the config is deepseek_v41's, but template recipe "
                                            r"'dsv4-tiny' is deepseek_v4's"):
        recipe_from_hf_config(config, load_recipe("dsv4-tiny"), "x")


def test_cli_from_hf_writes_a_v41_recipe(config, tiny, tmp_path):
    folder = tmp_path / "DeepSeek-V4.1-Tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "r.yaml"
    result = CliRunner().invoke(main, ["recipe", "from-hf", str(folder / "config.json"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    recipe = load_recipe(out)
    assert recipe.name == "deepseek-v4.1-tiny" and recipe.model.family == "deepseek_v41"
    assert recipe.model.engram.layer_ids == tiny.model.engram.layer_ids
    printed = CliRunner().invoke(main, ["recipe", "from-hf", str(folder)])
    assert printed.exit_code == 0 and printed.stdout == out.read_text()
    assert "dsv41-tiny" in printed.stdout.splitlines()[1]  # the template it took the passes from


def test_cli_from_hf_v41_errors_are_one_line(config, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, "dspark_markov_rank": -1}))
    result = CliRunner().invoke(main, ["recipe", "from-hf", str(path)])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [f"error: {path}: dspark_markov_rank: -1 is less than 1"]
