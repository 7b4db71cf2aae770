"""Hugging Face DeepSeek V4 import: config.json -> recipe, checkpoint directory -> weights."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.hf.checkpoint import load_hf_checkpoint
from b12x_toolchain.exporter.hf.config import HfConfigError, model_fields, read_config, recipe_from_hf_config
from b12x_toolchain.exporter.hf.config_writer import hf_config_dict
from b12x_toolchain.exporter.model.weights import weight_specs
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe, parse_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_from_dict, recipe_variant
from b12x_toolchain.exporter.train.tokenizer import save_tokenizer, train_tokenizer
from b12x_toolchain.runtime.package.checkpoint import CheckpointError
from hf_reference import INDEX, fp32_tiny_recipe, save_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny():
    return fp32_tiny_recipe()  # the fp32 checkpoint's recipe; from-hf writes no `weights` section


@pytest.fixture(scope="module")
def tiny_yaml(tiny, tmp_path_factory) -> Path:
    """The fp32 recipe as a file named like the bundled one, for the CLI's --recipe."""
    path = tmp_path_factory.mktemp("recipe") / "dsv4-tiny.yaml"
    path.write_text(yaml.safe_dump(tiny.normalized()))
    return path


@pytest.fixture(scope="module")
def dims(tiny):
    return Dims.from_recipe(tiny)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Written by transformers' save_pretrained in its default (DeepSeek release) layout."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "tiny-v4", seed=0)


@pytest.fixture()
def config(ckpt):
    return read_config(ckpt.path / "config.json")


def copy_of(ckpt, tmp_path) -> Path:
    """A copy of the checkpoint for one test to edit."""
    return Path(shutil.copytree(ckpt.path, tmp_path / "ckpt"))


def edit_tensors(root: Path, edit) -> None:
    """Rewrite every shard with `edit(tensors)` applied (it changes the dict in place), and the index."""
    index = json.loads((root / INDEX).read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = safetensors.torch.load_file(str(root / shard))
        edit(tensors)
        safetensors.torch.save_file(tensors, str(root / shard))
        weight_map.update({name: shard for name in tensors})
    index["weight_map"] = weight_map
    (root / INDEX).write_text(json.dumps(index))


def edit_config(root: Path, **changes) -> None:
    config = json.loads((root / "config.json").read_text())
    config.update(changes)
    (root / "config.json").write_text(json.dumps(config))


def expected_weights(ckpt) -> dict[str, torch.Tensor]:
    """The transformers model's own state dict, plus the MTP stage it does not hold."""
    state = ckpt.model.state_dict()
    return {name: state[name] if name in state else ckpt.weights[name] for name in ckpt.weights}


# --- config.json -> recipe ----------------------------------------------------------

def test_from_hf_gives_the_bundled_tiny_recipe(config, tiny):
    doc = recipe_from_hf_config(config, tiny, "dsv4-tiny")
    parsed = recipe_from_dict(doc)
    assert parsed.normalized() == tiny.normalized()


def test_from_hf_inverts_hf_config_dict(tiny):
    doc = recipe_from_hf_config(hf_config_dict(tiny), tiny, tiny.name)
    assert recipe_from_dict(doc).normalized() == tiny.normalized()


def test_from_hf_sets_the_window_fusion_sites_from_the_layer_count(config, tiny):
    six = {**config, "num_hidden_layers": 6,
           "layer_types": config["layer_types"] + ["sliding_attention", "compressed_sparse_attention"],
           "mlp_layer_types": config["mlp_layer_types"] + ["moe", "moe"]}
    recipe = recipe_from_dict(recipe_from_hf_config(six, tiny, "six", max_seq_len=2048))
    assert recipe.model.compress_ratios == (0, 4, 16, 4, 0, 4, 0)
    assert recipe.model.max_seq_len == 2048
    assert recipe.rewrites[0].expect_matches == {"prefill": 0, "verify": 6, "draft": 0, "commit": 0, "decode": 0}


def test_legacy_spellings_map_like_the_modern_ones(config):
    legacy = copy.deepcopy(config)
    for key in ("layer_types", "compress_rates", "mlp_layer_types", "partial_rotary_factor", "rope_parameters"):
        del legacy[key]
    legacy.update(compress_ratios=[0, 4, 128, 4, 0], compress_rate_csa=4, compress_rate_hca=16, num_hash_layers=1,
                  qk_rope_head_dim=16, rope_scaling={"type": "yarn", "factor": 16.0,
                                                     "original_max_position_embeddings": 64})
    assert model_fields(legacy)[0] == model_fields(config)[0]


def test_flat_rope_parameters_are_the_compress_ropes(config):
    # As transformers reads them: its rope_theta is overwritten by compress_rope_theta.
    flat = {**config, "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "rope_theta": 10000.0,
                                          "original_max_position_embeddings": 64}}
    assert model_fields(flat)[0] == model_fields(config)[0]


def test_nested_yarn_must_not_rescale(config):
    nested = copy.deepcopy(config)
    del nested["rope_parameters"]["compress"]["attention_factor"]  # transformers would apply YaRN's mscale
    with pytest.raises(HfConfigError, match=r"^rope_parameters\.compress\.attention_factor: missing"):
        model_fields(nested)


def test_default_compress_rope_means_no_yarn(config):
    plain = {**config, "rope_parameters": {"main": config["rope_parameters"]["main"],
                                           "compress": {"rope_type": "default", "rope_theta": 160000.0}}}
    assert model_fields(plain)[0]["yarn"] is None


@pytest.mark.parametrize("changes, key", [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"num_nextn_predict_layers": 0}, "num_nextn_predict_layers"),
    ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
    ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]},
     "layer_types[1]"),
    ({"mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]}, "mlp_layer_types[1]"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method"),
    ({"model_type": "deepseek_v3"}, "model_type"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),
    ({"scoring_func": "tanh"}, "scoring_func"),
])
def test_from_hf_refuses_what_b12x_cannot_reproduce_naming_the_key(config, tiny, changes, key):
    with pytest.raises(HfConfigError) as caught:
        recipe_from_hf_config({**config, **changes}, tiny, "x")
    assert str(caught.value).startswith(f"{key}: ")


def test_no_mtp_stage_says_the_recipe_needs_one(config, tiny):
    with pytest.raises(HfConfigError, match="needs one MTP draft stage"):
        recipe_from_hf_config({**config, "num_nextn_predict_layers": 0}, tiny, "x")


def test_a_missing_key_is_named(config, tiny):
    del config["sliding_window"]
    with pytest.raises(HfConfigError, match=r"^sliding_window: missing from config.json"):
        recipe_from_hf_config(config, tiny, "x")


# --- checkpoint directory -> weights ------------------------------------------------

def test_import_gives_the_models_state_dict_and_the_mtp_stage(ckpt, dims):
    weights = load_hf_checkpoint(ckpt.path, dims)
    assert list(weights) == list(weight_specs(dims))
    expected = expected_weights(ckpt)
    for name, tensor in weights.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


def test_import_reads_state_dict_names_too(tmp_path, dims):
    ckpt = save_tiny_checkpoint(tmp_path / "sd", seed=1, original_format=False)
    weights = load_hf_checkpoint(ckpt.path, dims)
    assert all(torch.equal(weights[name], t) for name, t in expected_weights(ckpt).items())


def test_import_reads_a_single_file_checkpoint(ckpt, tmp_path, dims):
    root = copy_of(ckpt, tmp_path)
    index = json.loads((root / INDEX).read_text())
    merged = {}
    for shard in sorted(set(index["weight_map"].values())):
        merged.update(safetensors.torch.load_file(str(root / shard)))
        (root / shard).unlink()
    (root / INDEX).unlink()
    safetensors.torch.save_file(merged, str(root / "model.safetensors"))
    weights = load_hf_checkpoint(root, dims)
    assert all(torch.equal(weights[name], t) for name, t in expected_weights(ckpt).items())


def test_tied_embeddings_use_the_embedding_as_lm_head(ckpt, tmp_path, dims):
    root = copy_of(ckpt, tmp_path)
    edit_config(root, tie_word_embeddings=True)
    edit_tensors(root, lambda t: t.pop("head.weight", None))
    weights = load_hf_checkpoint(root, dims)
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert weights["lm_head.weight"].data_ptr() != weights["model.embed_tokens.weight"].data_ptr()


def _drop(name):
    return lambda t: t.pop(name, None)


def _put(name, tensor, beside="model.layers.0.attn.wq_a.weight"):
    return lambda t: t.__setitem__(name, tensor) if beside in t else None  # into one shard only


def _retype(name, dtype):
    return lambda t: t.__setitem__(name, t[name].to(dtype)) if name in t else None


def _reshape(name, shape):
    return lambda t: t.__setitem__(name, torch.zeros(shape)) if name in t else None


@pytest.mark.parametrize("edit, pattern", [
    (_drop("model.layers.2.attn.wkv.weight"),
     r"^model\.layers\.2\.self_attn\.kv_proj\.weight: not in the checkpoint; the recipe expects float32 \[64, 64\]$"),
    (_drop("model.layers.1.ffn.experts.3.w3.weight"),
     r"^routed expert 3's up rows of model\.layers\.1\.mlp\.experts\.gate_up_proj: not in the checkpoint; "
     r"the recipe expects float32 \[64, 64\]"),
    (_drop("mtp.0.hc_head_fn"), r"^mtp\.0\.hc_head\.hc_fn: not in the checkpoint; .*MTP stage"),
    (_put("model.layers.0.attn.extra_proj.weight", torch.zeros(2, 2)),
     r"^model\.layers\.0\.attn\.extra_proj\.weight: in the checkpoint but not a weight of the recipe's model"),
    (_put("model.layers.0.ffn.experts.4.w1.weight", torch.zeros(64, 64)),
     r"^model\.layers\.0\.ffn\.experts\.4\.w1\.weight: in the checkpoint but not a weight"),
    (_reshape("model.layers.2.attn.wkv.weight", (64, 32)),
     r"^model\.layers\.2\.attn\.wkv\.weight: shape \[64, 32\] in model-\d+-of-\d+\.safetensors does not match "
     r"the recipe's \[64, 64\] \(it holds model\.layers\.2\.self_attn\.kv_proj\.weight\)$"),
    (_retype("model.layers.3.ffn.gate.weight", torch.bfloat16),
     r"^model\.layers\.3\.ffn\.gate\.weight: dtype bfloat16 in .* does not match the recipe's float32"),
    (_retype("model.layers.0.ffn.gate.tid2eid", torch.int32),
     r"^model\.layers\.0\.ffn\.gate\.tid2eid: dtype int32 in .* does not match the recipe's int64"),
    (_retype("mtp.0.ffn.experts.2.w2.weight", torch.bfloat16),
     r"^mtp\.0\.ffn\.experts\.2\.w2\.weight: dtype bfloat16 .* \(it holds routed expert 2's down rows of "
     r"mtp\.0\.mlp\.experts\.down_proj\)$"),
])
def test_import_refuses_a_checkpoint_that_is_not_the_recipes(ckpt, tmp_path, dims, edit, pattern):
    root = copy_of(ckpt, tmp_path)
    edit_tensors(root, edit)
    with pytest.raises(CheckpointError, match=pattern):
        load_hf_checkpoint(root, dims)


def test_import_refuses_two_names_for_one_weight(ckpt, tmp_path, dims):
    root = copy_of(ckpt, tmp_path)
    edit_tensors(root, lambda t: t.update({"lm_head.weight": t["head.weight"].clone()}) if "head.weight" in t else None)
    with pytest.raises(CheckpointError, match=r"^lm_head\.weight: holds the same weight as head\.weight"):
        load_hf_checkpoint(root, dims)


@pytest.mark.parametrize("changes, pattern", [
    ({"hidden_size": 32}, r"^config\.json: hidden_size gives model\.hidden_size = 32, but the recipe's is 64$"),
    ({"layer_types": ["sliding_attention"] + ["compressed_sparse_attention"] * 3},
     r"^config\.json: layer_types gives model\.compress_ratios = \[0, 4, 4, 4, 0\], but the recipe's is "
     r"\[0, 4, 16, 4, 0\]$"),
    ({"index_topk": 8}, r"^config\.json: index_topk gives model\.indexer\.topk = 8"),
    ({"num_key_value_heads": 4}, r"^config\.json: num_key_value_heads: 4 is not supported"),
])
def test_import_refuses_a_config_for_another_model(ckpt, tmp_path, dims, changes, pattern):
    root = copy_of(ckpt, tmp_path)
    edit_config(root, **changes)
    with pytest.raises(CheckpointError, match=pattern):
        load_hf_checkpoint(root, dims)


def test_a_v4_checkpoint_is_not_a_v41_recipes(ckpt):
    with pytest.raises(CheckpointError, match=r"^config\.json: has no Engram keys"):
        load_hf_checkpoint(ckpt.path, Dims.from_recipe(load_recipe("dsv41-tiny")))
    # Without Engram layers, its weights are not the V4.1 model's.
    with pytest.raises(CheckpointError, match="not a weight of the recipe's model"):
        load_hf_checkpoint(ckpt.path, Dims.from_recipe(recipe_variant(load_recipe("dsv41-tiny"),
                                                                      {"model.engram": None})))


# --- the command line ---------------------------------------------------------------

def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_cli_from_hf_writes_a_recipe_that_loads(ckpt, tmp_path, tiny):
    out = tmp_path / "tiny.yaml"
    result = run("recipe", "from-hf", ckpt.path / "config.json", "--name", "dsv4-tiny", "--out", out)
    assert result.exit_code == 0, result.output
    assert load_recipe(out).normalized() == tiny.normalized()
    printed = run("recipe", "from-hf", ckpt.path / "config.json", "--name", "dsv4-tiny")
    assert printed.exit_code == 0 and printed.stdout == out.read_text()
    assert parse_recipe(run("recipe", "from-hf", ckpt.path).stdout).name == "tiny-v4"  # the directory's name


def test_cli_from_hf_errors_are_one_line_and_write_nothing(ckpt, tmp_path):
    root = copy_of(ckpt, tmp_path)
    out = tmp_path / "r.yaml"
    edit_config(root, num_key_value_heads=2)
    line = one_error_line(run("recipe", "from-hf", root / "config.json", "--out", out))
    assert "num_key_value_heads: 2 is not supported" in line
    # a recipe the schema refuses: max_seq_len not a multiple of the HCA ratio
    line = one_error_line(run("recipe", "from-hf", ckpt.path, "--max-seq-len", "1000", "--out", out))
    assert "model.max_seq_len: 1000 is not a multiple of compress ratio" in line
    assert "does not exist" in one_error_line(run("recipe", "from-hf", tmp_path / "none.json", "--out", out))
    assert not out.exists()


def test_cli_export_checkpoint_errors_are_one_line_and_write_nothing(ckpt, tiny_yaml, tmp_path):
    root = copy_of(ckpt, tmp_path)
    edit_tensors(root, _drop("model.layers.2.attn.wkv.weight"))
    out = tmp_path / "out"
    line = one_error_line(run("export", "--recipe", tiny_yaml, "--checkpoint", root, "--out", out))
    assert f"checkpoint {root}: model.layers.2.self_attn.kv_proj.weight: not in the checkpoint" in line
    line = one_error_line(run("export", "--recipe", tiny_yaml, "--checkpoint", ckpt.path, "--weights", "init",
                              "--out", out))
    assert "--checkpoint supplies the weights" in line
    assert not out.exists()


class Stop(Exception):
    pass


def export_arguments(monkeypatch, *args) -> dict:
    """What `b12x export ARGS` hands export_package, which stops there."""
    import b12x_toolchain.exporter.pipeline.export as export_module

    seen = {}

    def fake_export_package(recipe, out_dir, **kwargs):
        seen.update(kwargs, recipe=recipe)
        raise Stop

    monkeypatch.setattr(export_module, "export_package", fake_export_package)
    result = run("export", *args)
    assert isinstance(result.exception, Stop), result.output
    return seen


def test_cli_export_checkpoint_passes_the_imported_weights(ckpt, tiny_yaml, tmp_path, monkeypatch):
    seen = export_arguments(monkeypatch, "--recipe", tiny_yaml, "--checkpoint", ckpt.path, "--out", tmp_path / "out")
    assert seen["recipe"].name == "dsv4-tiny" and seen["tokenizer"] is None
    assert seen["weights_source"] == "Hugging Face checkpoint tiny-v4"
    assert not seen["structural"]
    expected = expected_weights(ckpt)
    assert list(seen["weights"]) == list(expected)
    assert all(torch.equal(seen["weights"][name], t) for name, t in expected.items())


def test_cli_export_checkpoint_passes_its_tokenizer(ckpt, tiny_yaml, tmp_path, monkeypatch):
    root = copy_of(ckpt, tmp_path)
    save_tokenizer(train_tokenizer(["def f(x):\n    return x\n"], vocab_size=300), root)
    seen = export_arguments(monkeypatch, "--recipe", tiny_yaml, "--checkpoint", root, "--out", tmp_path / "out")
    tokenizer = seen["tokenizer"]
    assert tokenizer.files == {f"tokenizer/{n}": (root / n).read_bytes()
                               for n in ("tokenizer.json", "tokenizer_config.json")}
    assert (tokenizer.facts.eos_token_id, tokenizer.facts.pad_token_id, tokenizer.facts.chat_template) == (0, 2, True)
    (root / "tokenizer.json").write_text("{}")
    line = one_error_line(run("export", "--recipe", tiny_yaml, "--checkpoint", root, "--out", tmp_path / "out"))
    assert f"checkpoint {root}: tokenizer.json: not a tokenizer the tokenizers library reads" in line


def test_the_import_needs_no_transformers():
    # transformers is a test dependency only: the exporter reads config.json as JSON.
    code = ("import sys, b12x_toolchain.exporter.hf.checkpoint, b12x_toolchain.exporter.cli.cmd_recipe, b12x_toolchain.exporter.cli.main;"
            "sys.exit(1 if 'transformers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
