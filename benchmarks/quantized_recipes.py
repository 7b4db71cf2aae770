"""The recipes the quantized-weight benchmarks export (load_memory, quantized_decode).

`dsv41-tiny` in the weight formats of DeepSeek's V4.1 release (FP8 E4M3 in 32x32 blocks with
UE8M0 scales, FP4 E2M1 routed experts, BF16 where the release keeps it), and its fp32 twin:
the same recipe without a `weights` section, so the two differ only in how weights are stored.
No benchmark here; the runner imports it like any module of this folder.
"""

from __future__ import annotations

from pathlib import Path

from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant

BASE = "dsv41-tiny"
FP8_ROLES = ("attention", "indexer_query", "shared_experts", "draft_input")
BF16_ROLES = ("embeddings", "head", "compressor", "router", "norms")
ACTIVATIONS = ("none", "deepseek")


def v41_release_weights(activation: str) -> dict:
    """The `weights` section of the V4.1 release's formats, with activation rule `activation`."""
    section = {"activation": activation, "routed_experts": "fp4_e2m1"}
    section.update({role: {"format": "fp8_e4m3", "block": [32, 32], "scale": "ue8m0"} for role in FP8_ROLES})
    section.update({role: "bf16" for role in BF16_ROLES})
    return section


def variant(changes: dict, name: str, base: str = BASE):
    """Bundled recipe `base` with dotted-path keys replaced (`model.hidden_size`), named `name`."""
    return recipe_variant(load_recipe(base), changes, name=name)


def twins(changes: dict, name: str, activation: str = "none") -> tuple:
    """(quantized, fp32 twin) of `base` with `changes`: the same model, weights stored two ways."""
    quantized = variant({**changes, "weights": v41_release_weights(activation)}, f"{name}-q-{activation}")
    return quantized, variant(changes, f"{name}-fp32")


def exported(recipe, folder: Path) -> Path:
    """`recipe`'s package in `folder`, exported there unless it already is (random weights)."""
    path = folder / f"{recipe.name}.b12x"
    if not (path / "manifest.json").exists():
        export_package(recipe, folder)
    return path
