"""The recipe's `weights` section: formats per role, refused at the line that cannot hold."""

from __future__ import annotations

import json

import pytest

from b12x_toolchain.exporter.model.weight_roles import ROLES, role_of
from b12x_toolchain.exporter.model.weights import logical_specs, weight_formats, weight_specs
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe, parse_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.exporter.recipe.weights import WeightsSpec
from decode_steps import FP32_WEIGHTS
from paths import ROOT
from recipe_text import TINY_TEXT, edit, line_of, parse_error

FP8_32 = "{format: fp8_e4m3, block: [32, 32], scale: ue8m0}"
V41_SCHEME = f"""weights:
  activation: deepseek
  attention: {FP8_32}
  indexer_query: {FP8_32}
  shared_experts: {FP8_32}
  routed_experts: fp4_e2m1
  draft_input: {FP8_32}
  embeddings: bf16
  head: bf16
"""


def with_weights(section: str, text: str = TINY_TEXT) -> str:
    return text + section


def section_line(text: str, key: str) -> int:
    """The line of `  key:` in the section appended last."""
    lines = text.splitlines()
    return max(n for n, line in enumerate(lines, 1) if line.startswith(f"  {key}:"))


# The digests the CI fingerprints were exported with before the section existed; dsv4-tiny
# and dsv41 have since taken their releases' formats, and the V4.1 recipes Engram, so their
# fingerprints moved. Dropping both optional parts gives the digests back.
DIGESTS_BEFORE_THE_SECTION = {
    "dsv4-tiny": "6facb50787816fb7e588a0f98ef68e6f076620cc5cb61096b0ac4a6b577b5858",
    "dsv41": "cfadade3c5e23e4e4c9e2bdb7f9a48a28bbf5b267bcd6349f9019c69ff7a8672",
    "dsv41-tiny": "7691eb13b0ba0cba8da3e039ded4fd109caf0eaa6a83fda304bc0a365ac9c455",
}
WITHOUT_ENGRAM = {"model.engram": None}


@pytest.mark.parametrize("name", ["dsv4-tiny", "dsv41", "dsv41-tiny"])
def test_a_recipe_without_the_section_keeps_its_digest(name):
    recipe = recipe_variant(load_recipe(name), {**FP32_WEIGHTS, **({} if name == "dsv4-tiny" else WITHOUT_ENGRAM)})
    assert "weights" not in recipe.normalized() and recipe.sha256() == DIGESTS_BEFORE_THE_SECTION[name]
    d = Dims.from_recipe(recipe)
    assert weight_formats(d) == {} and {dtype for _, dtype in weight_specs(d).values()} == {"float32", "int64"}


def test_dsv41_tiny_stays_fp32_and_keeps_its_fingerprint():
    pinned = json.loads((ROOT / "examples/ci/fingerprints/dsv41-tiny.manifest.json").read_text())["recipe_sha256"]
    assert "weights" not in load_recipe("dsv41-tiny").normalized()
    assert pinned == load_recipe("dsv41-tiny").sha256()


@pytest.mark.parametrize("name, fp8", [("dsv4-tiny", "fp8_e4m3 128x128 ue8m0"), ("dsv41", "fp8_e4m3 32x32 ue8m0")])
def test_the_bundled_releases_store_their_formats(name, fp8):
    # V4 Instruct: 128x128 blocks, V4.1: 32x32; both FP4 experts, BF16 where the release keeps
    # it (dsv41's unpublished DSpark heads too), under DeepSeek's activation rule.
    weights = load_recipe(name).weights
    formats = {role: fmt.describe() for role, fmt in weights.formats().items()}
    assert weights.activation == "deepseek"
    engram = {"engram_projection"} if name == "dsv41" else set()  # and its tables in 1x32 blocks
    assert {role for role, kind in formats.items() if kind == fp8} == {"attention", "indexer_query", "shared_experts",
                                                                      "draft_input"} | engram
    assert formats["routed_experts"] == "fp4_e2m1 1x32 ue8m0"
    assert formats["engram_tables"] == ("fp8_e4m3 1x32 ue8m0" if name == "dsv41" else "fp32")
    bf16 = {"embeddings", "head", "compressor", "router", "norms"} | ({"draft_heads"} if name == "dsv41" else set())
    assert {role for role, kind in formats.items() if kind == "bf16"} == bf16


def test_every_role_is_a_recipe_key_and_every_weight_has_at_most_one_role():
    assert tuple(k for k in WeightsSpec.model_fields if k != "activation") == ROLES
    found = set()
    for name in ("dsv41-tiny", "dsv4-tiny"):
        names = logical_specs(Dims.from_recipe(load_recipe(name)))
        found |= {role_of(n) for n in names}
        # A weight without a role keeps its format: sinks, mHC mixers, biases, the hash table.
        fixed = [n for n in names if role_of(n) is None]
        assert all(n.endswith(("sinks", "tid2eid", "token_map", "position_bias", "bias")) or "_hc." in n or ".hc_head." in n
                   for n in fixed), fixed
    assert found == {*ROLES, None}  # the two families hold every role between them


def test_the_v41_scheme_gives_each_tensor_its_stored_form():
    recipe = parse_recipe(with_weights(V41_SCHEME), "t.yaml")
    assert recipe.normalized()["weights"]["routed_experts"] == {"format": "fp4_e2m1", "block": [1, 32], "scale": "ue8m0"}
    assert recipe.normalized()["weights"]["norms"] == {"format": "fp32", "block": None, "scale": None}
    assert recipe.sha256() != load_recipe("dsv41-tiny").sha256()
    # The normalised form reads back as the same recipe (a manifest holds it).
    assert parse_recipe(json.dumps(recipe.normalized()), "n.yaml").sha256() == recipe.sha256()
    d = Dims.from_recipe(recipe)
    specs = weight_specs(d)
    q = "model.layers.0.self_attn.q_a_proj.weight"  # [q_lora 64, hidden 128]
    assert (specs[q], specs[q + "_scale"]) == (((64, 128), "float8_e4m3fn"), ((2, 4), "float8_e8m0fnu"))
    up = "model.layers.0.mlp.experts.gate_up_proj"  # [experts 4, 2 x 128, hidden 128]
    assert (specs[up], specs[up + "_scale"]) == (((4, 256, 64), "int8"), ((4, 256, 4), "float8_e8m0fnu"))
    assert specs["lm_head.weight"] == ((512, 128), "bfloat16") and "lm_head.weight_scale" not in specs
    assert specs["model.norm.weight"] == ((128,), "float32") and d.activation == "deepseek"
    assert specs["model.layers.0.mlp.gate.tid2eid"][1] == "int64"


@pytest.mark.parametrize("section, key, fragment", [
    ("weights:\n  attention: {format: fp8_e4m3, block: [64, 64], scale: ue8m0}\n", "weights.attention.block",
     "64x64 is not a block fp8_e4m3 takes (128x128, 32x32, 1x32)"),
    ("weights:\n  attention: {format: fp8_e4m3, block: [32, 32]}\n", "weights.attention.scale",
     "fp8_e4m3 needs a scale encoding (ue8m0, fp32)"),
    ("weights:\n  routed_experts: {format: fp4_e2m1, scale: fp32}\n", "weights.routed_experts.scale",
     "'fp32' is not the scale encoding fp4_e2m1 takes (ue8m0)"),
    ("weights:\n  routed_experts: {format: fp4_e2m1, block: [32, 32]}\n", "weights.routed_experts.block",
     "32x32 is not the block fp4_e2m1 takes (1x32)"),
    ("weights:\n  head: {format: bf16, scale: ue8m0}\n", "weights.head.scale", "bf16 carries no scale"),
    ("weights:\n  attention: fp4_e2m1\n", "weights.attention.format",
     "fp4_e2m1 is not a format attention takes (fp32, bf16, fp8_e4m3)"),
    (f"weights:\n  head: {FP8_32}\n", "weights.head.format", "fp8_e4m3 is not a format head takes (fp32, bf16)"),
    ("weights:\n  embeddings: fp16\n", "weights.embeddings.format", "Input should be"),
    ("weights:\n  experts: bf16\n", "weights.experts", "unknown key 'experts'"),
    ("weights:\n  activation: deepseek\n  head: bf16\n", "weights.activation", "no role is fp8_e4m3 or fp4_e2m1"),
])
def test_a_format_the_role_cannot_take_is_refused_at_its_line(section, key, fragment):
    text = with_weights(section)
    err = parse_error(text)
    assert (err.key_path, err.line) == (key, section_line(text, key.split(".")[1])), str(err)
    assert fragment in str(err), str(err)


MOE = "intermediate_size: 128\n    hash"


@pytest.mark.parametrize("intermediate, section, key, fragment", [
    # Each half of a fused gate_up holds 160 rows: a 128-row block would hold gate and up rows.
    ("160", "weights:\n  routed_experts: {format: fp8_e4m3, block: [128, 128], scale: fp32}\n",
     "weights.routed_experts.block", "128x128 blocks straddle gate and up of model.layers.0.mlp.experts.gate_up_proj"),
    ("144", "weights:\n  routed_experts: fp4_e2m1\n", "weights.routed_experts.format",
     "model.layers.0.mlp.experts.down_proj: input dimension 144 is not a multiple of 32"),
])
def test_a_format_the_tensor_cannot_take_is_refused_at_the_role(intermediate, section, key, fragment):
    text = with_weights(section, edit(MOE, f"intermediate_size: {intermediate}\n    hash"))
    err = parse_error(text)
    assert (err.key_path, err.line) == (key, section_line(text, "routed_experts")), str(err)
    assert fragment in str(err), str(err)


@pytest.mark.parametrize("intermediate, parallel, section, fragment", [
    # o_a_proj [groups x o_lora = 64, 64] is split by whole groups: 32 rows a rank, a quarter of a block.
    ("128", "{tensor: 2, expert: 2}", "weights:\n  attention: {format: fp8_e4m3, block: [128, 128], scale: ue8m0}\n",
     "2 ranks cut model.layers.0.self_attn.o_a_proj.weight (fp8_e4m3 128x128 ue8m0) into 32 rows a rank"),
    # Without expert parallelism down_proj [E, D, 96] is split by its 96 inputs: 48 a rank, not whole groups of 32.
    ("96", "{tensor: 2}", "weights:\n  routed_experts: fp4_e2m1\n",
     "2 ranks cut model.layers.0.mlp.experts.down_proj (fp4_e2m1 1x32 ue8m0) into 48 columns a rank"),
])
def test_a_split_that_cuts_a_scale_block_is_refused_at_the_parallel_line(intermediate, parallel, section, fragment):
    text = edit(MOE, f"intermediate_size: {intermediate}\n    hash") + f"parallel: {parallel}\n" + section
    err = parse_error(text)
    assert (err.key_path, err.line) == ("parallel.tensor", line_of(text, "parallel:")), str(err)
    assert fragment in str(err), str(err)


def test_splits_on_block_boundaries_are_taken():
    text = with_weights(V41_SCHEME, TINY_TEXT + "parallel: {tensor: 2, expert: 2}\n")
    d = Dims.from_recipe(parse_recipe(text, "t.yaml"))
    assert (d.tensor, dict(d.role_formats)["routed_experts"].kind) == (2, "fp4_e2m1")
