"""`recipe from-hf` of a quantized config.json: the `weights` section it writes, what it
refuses by key, and the round trip to `export --checkpoint` on a release-layout checkpoint.

The round trip is test_quantized_weights' package under DeepSeek's activation rule, which
that module replays against transformers: it is made once per test run, by whichever
module asks first (from_hf_export), and checked here for what the command line stores."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.hf.checkpoint import load_hf_checkpoint
from b12x_toolchain.exporter.hf.config import HfConfigError, recipe_from_hf_config
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.weights import WeightsSpec
from b12x_toolchain.runtime import load
from hf_reference import small_v4_recipe, tiny_v4_config
from release_checkpoint import release_config
from release_package import RECIPE_FILE, from_hf_export, release_checkpoint, v4_recipe

# One export of dsv4-tiny (two layers) in the release's formats, unless test_quantized_weights made it first.
pytestmark = pytest.mark.slow(minutes=0.5)

BF16_ROLES = {"head": "bf16", "embeddings": "bf16", "compressor": "bf16", "router": "bf16", "norms": "bf16"}


def fp8(block: int, scale: str = "ue8m0") -> dict:
    return {"format": "fp8_e4m3", "block": [block, block], "scale": scale}


# The release's scheme written out by hand: FP8 linears, FP4 routed experts, BF16 kept tensors.
V4_WEIGHTS = {"activation": "deepseek", "attention": fp8(128), "indexer_query": fp8(128),
              "shared_experts": fp8(128), "routed_experts": "fp4_e2m1", "draft_input": fp8(128), **BF16_ROLES}
V41_WEIGHTS = {"activation": "deepseek", "attention": fp8(32), "indexer_query": fp8(32),
               "shared_experts": fp8(32), "routed_experts": "fp4_e2m1", "draft_input": fp8(32), **BF16_ROLES}


@pytest.fixture(scope="module")
def tiny():
    return load_recipe("dsv4-tiny")


@pytest.fixture(scope="module")
def v4_config():
    """config.json of the V4 release: 128x128 UE8M0 blocks, expert_dtype at the top level."""
    return release_config(tiny_v4_config(), block=(128, 128))


def test_v4_release_config_gives_the_release_weights(v4_config, tiny):
    assert recipe_from_hf_config(v4_config, tiny, "x")["weights"] == V4_WEIGHTS


def test_v41_release_config_gives_its_32x32_blocks(tiny):
    v41 = release_config(tiny_v4_config(), block=(32, 32), expert_dtype_inside=True)
    assert "expert_dtype" not in v41 and v41["quantization_config"]["expert_dtype"] == "fp4"
    assert recipe_from_hf_config(v41, tiny, "x")["weights"] == V41_WEIGHTS


def test_float_scales_give_fp32_scales_and_no_activation_rounding(tiny):
    config = release_config(tiny_v4_config(), block=(128, 128), scale_dtype="fp32")
    assert "scale_fmt" not in config["quantization_config"]
    want = {**V4_WEIGHTS, **{role: fp8(128, "fp32") for role in
                             ("attention", "indexer_query", "shared_experts", "draft_input")}, "activation": "none"}
    assert recipe_from_hf_config(config, tiny, "x")["weights"] == want


def test_an_unquantized_config_gives_no_weights_section(v4_config, tiny):
    plain = {k: v for k, v in v4_config.items() if k not in ("quantization_config", "expert_dtype")}
    assert "weights" not in recipe_from_hf_config(plain, tiny, "x")


def _edited(config: dict, edit) -> dict:
    config = copy.deepcopy(config)
    edit(config)
    return config


REFUSALS = {
    "fp8 experts (V4)": (lambda c: c.update(expert_dtype="fp8"),
                         "expert_dtype: 'fp8' (fp8_e4m3 routed experts); b12x has no routed-expert op for fp8_e4m3 "
                         "yet, only for 'fp4' (fp4_e2m1)"),
    "fp8 experts (V4.1)": (lambda c: [c.pop("expert_dtype"), c["quantization_config"].update(expert_dtype="fp8")],
                           "quantization_config.expert_dtype: 'fp8' (fp8_e4m3 routed experts)"),
    "no expert_dtype": (lambda c: c.pop("expert_dtype"), "expert_dtype: missing, which declares 'fp8'"),
    "quant_method": (lambda c: c["quantization_config"].update(quant_method="awq"),
                     "quantization_config.quant_method: 'awq' is not DeepSeek's 'fp8'"),
    "block": (lambda c: c["quantization_config"].update(weight_block_size=[64, 64]),
              "quantization_config.weight_block_size: 64x64 is not a block fp8_e4m3 takes (128x128, 32x32, 1x32)"),
    "activation": (lambda c: c["quantization_config"].update(activation_scheme="static"),
                   "quantization_config.activation_scheme: 'static' is not 'dynamic'"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refuses_what_the_recipe_cannot_represent_by_key(v4_config, tiny, case):
    edit, message = REFUSALS[case]
    with pytest.raises(HfConfigError) as caught:
        recipe_from_hf_config(_edited(v4_config, edit), tiny, "x")
    assert str(caught.value).startswith(message)


# --- the command line ---------------------------------------------------------------

def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def checkpoint(run_dir):
    """A V4 release-layout checkpoint of dsv4-tiny's model cut to two layers (SMALL_V4)."""
    return release_checkpoint(run_dir)


@pytest.mark.parametrize("case", ["fp8 experts (V4)", "block", "quant_method"])
def test_cli_refusals_are_one_line_and_write_nothing(checkpoint, tmp_path, case):
    edit, message = REFUSALS[case]
    config = _edited(json.loads((checkpoint / "config.json").read_text()), edit)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "r.yaml"
    result = run("recipe", "from-hf", tmp_path / "config.json", "--out", out)
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()  # one error line, no traceback
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert not out.exists()


def test_from_hf_then_export_checkpoint_round_trips(checkpoint, run_dir):
    path = from_hf_export(run_dir)  # where both commands run, each must exit 0
    written = load_recipe(path.parents[1] / RECIPE_FILE)
    assert written.model == small_v4_recipe().model and written.weights == WeightsSpec.model_validate(V4_WEIGHTS)
    # The rest is the template's, which --template gave: fp32 caches, no decode pass.
    assert written.normalized() == v4_recipe().normalized()
    package = load(path)
    # Stored as the checkpoint stores them: FP8 data with UE8M0 scales, packed FP4 experts, BF16.
    assert package.weights["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert package.weights["model.layers.0.self_attn.q_a_proj.weight_scale"].dtype == torch.float8_e8m0fnu
    assert package.weights["model.layers.1.mlp.experts.down_proj"].dtype == torch.int8
    assert package.weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    imported = load_hf_checkpoint(checkpoint, Dims.from_recipe(written))
    assert set(package.weights) == set(imported)
    for name, tensor in imported.items():
        assert torch.equal(package.weights[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name
