"""The tiny V4 release package of test_quantized_weights and test_from_hf_weights: a release-layout
checkpoint (128x128 blocks) and the package made from it as a user makes one, `recipe from-hf`
then `export --checkpoint`, each once per test run by whichever module asks first."""

from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from conftest import once_per_run
from decode_steps import FP32_CACHES, SMALL_V4
from hf_reference import small_v4_config, small_v4_recipe, tiny_weights
from release_checkpoint import write_release_checkpoint

# The packages are replayed through prefill, verify and commit only (decode_steps): the optional
# decode pass, a fifth of an export's tracing, is left out.
NO_DECODE = {"passes.decode": None, "rewrites.0.expect_matches": {
    name: count for name, count in SMALL_V4["rewrites.0.expect_matches"].items() if name != "decode"}}

FP8_ROLES = ("attention", "indexer_query", "shared_experts", "draft_input")
BF16_ROLES = ("embeddings", "head", "compressor", "router", "norms")


def release_scheme(block: int, activation: str) -> dict:
    """The `weights` section of DeepSeek's Instruct release: V4 with 128x128 blocks, V4.1 32x32."""
    section = {"activation": activation, "routed_experts": "fp4_e2m1"}
    section.update({role: {"format": "fp8_e4m3", "block": [block, block], "scale": "ue8m0"} for role in FP8_ROLES})
    section.update({role: "bf16" for role in BF16_ROLES})
    return section


def v4_recipe():
    """The small V4 model in the V4 release's formats (128x128 blocks) under DeepSeek's activation rule."""
    return small_v4_recipe({**FP32_CACHES, **NO_DECODE, "weights": release_scheme(128, "deepseek")},
                           name="dsv4-small-release-deepseek")


def release_checkpoint(run_dir: Path) -> Path:
    """The V4 release-layout checkpoint (128x128 blocks), written once per test run."""
    def build(out):
        write_release_checkpoint(out / "v4", small_v4_config(), tiny_weights(seed=3, small=True), block=(128, 128))
        return out / "v4"

    return once_per_run(run_dir, "dsv4-small-release-checkpoint", build)


RECIPE_FILE = "release.yaml"  # beside the folder of the package from_hf_export returns


def from_hf_export(run_dir: Path) -> Path:
    """v4_recipe()'s package, made once per run from the release checkpoint with the
    command line: `recipe from-hf` (its template supplying the caches and passes), then
    `export --checkpoint` with the recipe written. A user's path, and test_from_hf_weights' round trip."""
    checkpoint = release_checkpoint(run_dir)

    def cli(*args):
        result = CliRunner().invoke(main, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        return result

    def build(out):
        recipe = v4_recipe()
        template = out / "template.yaml"
        template.write_text(yaml.safe_dump(small_v4_recipe({**FP32_CACHES, **NO_DECODE}, "template").normalized()))
        cli("recipe", "from-hf", checkpoint, "--template", template, "--name", recipe.name, "--out", out / RECIPE_FILE)
        cli("export", "--recipe", out / RECIPE_FILE, "--checkpoint", checkpoint, "--out", out / "pkg")
        return out / "pkg" / f"{recipe.name}.b12x"

    return once_per_run(run_dir, "dsv4-small-release-from-hf", build)
