"""Weight formats in the manifest: written only when not fp32, read strictly, in the ABI fingerprint,
and named by `b12x abi diff`."""

from __future__ import annotations

import copy

import pytest

from b12x_toolchain.exporter.compare.abi_diff import diff_manifests
from b12x_toolchain.exporter.recipe.loader import parse_recipe
from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.formats.weight_formats import WeightFormat
from b12x_toolchain.runtime.package.abi import contract, fingerprint
from b12x_toolchain.runtime.package.manifest import digest
from recipe_text import TINY_TEXT
from runtime.package.manifests import contract_manifest, edited, read_back

SCHEME = """weights:
  activation: none
  attention: {format: fp8_e4m3, block: [32, 32], scale: ue8m0}
  routed_experts: fp4_e2m1
  head: bf16
"""
Q_A = "model.layers.0.self_attn.q_a_proj.weight"


@pytest.fixture(scope="module")
def manifests(tiny_recipe):
    return contract_manifest(tiny_recipe), contract_manifest(parse_recipe(TINY_TEXT + SCHEME, "t.yaml"))


def test_an_all_fp32_package_writes_and_hashes_as_before(manifests):
    plain, _ = manifests
    assert set(plain["weights"]) == {"file", "source"}
    passes, buffers, caches = plain["passes"], plain["buffers"], plain["cache_formats"]
    assert fingerprint(contract(passes, buffers, caches)) == fingerprint(contract(passes, buffers, caches, {})) \
        == plain["abi_fingerprint"]


def test_formats_are_recorded_read_back_and_fingerprinted(manifests, tmp_path):
    plain, quantized = manifests
    weights = read_back(quantized, tmp_path).weights
    assert weights.formats[Q_A] == WeightFormat("fp8_e4m3", (32, 32), "ue8m0") and weights.activation == "none"
    assert weights.formats["lm_head.weight"] == WeightFormat("bf16") and "model.norm.weight" not in weights.formats
    assert quantized["abi_fingerprint"] != plain["abi_fingerprint"]
    # The calling convention binds the stored tensors: E4M3 data and its UE8M0 scale grid.
    inputs = {s["name"]: s for s in quantized["passes"]["verify"]["inputs"]}
    assert (inputs[Q_A]["dtype"], inputs[Q_A + "_scale"]["dtype"], inputs[Q_A + "_scale"]["shape"]) == \
        ("float8_e4m3fn", "float8_e8m0fnu", [2, 4])
    # A format edited without signing the conventions again is refused as such.
    tampered = copy.deepcopy(quantized)
    tampered["weights"]["formats"][Q_A]["block"] = [128, 128]
    tampered["manifest_sha256"] = digest(tampered)
    with pytest.raises(PackageError, match="abi_fingerprint does not match"):
        read_back(tampered, tmp_path)


@pytest.mark.parametrize("edit, fragment", [
    (lambda w: w["formats"].update({"model.norm.weight": {"kind": "fp32"}}),
     "weights.formats.model.norm.weight: {'kind': 'fp32'} is not another format than fp32"),
    (lambda w: w["formats"][Q_A].update(block=[64, 64]), f"weights.formats.{Q_A}.block: 64x64 is not a block"),
    (lambda w: w["formats"][Q_A].pop("scale_encoding"), f"weights.formats.{Q_A}.scale_encoding: fp8_e4m3 needs"),
    (lambda w: w.pop("activation"), "'formats' and 'activation' are written together"),
    (lambda w: w.update(activation="fp8"), "weights.activation: 'fp8' is not one of none, deepseek"),
    (lambda w: w["formats"].update({"model.norm.weight": {"kind": "bf16"}}),
     "weights.formats.model.norm.weight is bf16, stored as bfloat16 model.norm.weight; the passes have a float32 input"),
    (lambda w: w["formats"].update({"model.layers.0.mlp.gate.weight": w["formats"][Q_A]}),
     "stored as float8_e4m3fn model.layers.0.mlp.gate.weight; the passes have a float32 input"),
])
def test_a_bad_formats_entry_is_refused_by_name(manifests, tmp_path, edit, fragment):
    with pytest.raises(PackageError) as info:
        read_back(edited(manifests[1], lambda m: edit(m["weights"])), tmp_path)
    assert fragment in str(info.value)


def test_abi_diff_names_a_format_change(manifests):
    plain, quantized = manifests
    lines = diff_manifests(plain, quantized)
    assert f"weight {Q_A}: format fp32 -> fp8_e4m3 32x32 ue8m0" in lines
    assert "weight model.layers.0.mlp.experts.down_proj: format fp32 -> fp4_e2m1 1x32 ue8m0" in lines
    assert "weight lm_head.weight: format fp32 -> bf16" in lines
    other = edited(quantized, lambda m: m["weights"]["formats"][Q_A].update(scale_encoding="fp32"))
    assert other["abi_fingerprint"] != quantized["abi_fingerprint"]
    assert diff_manifests(quantized, other) == [f"weight {Q_A}: format fp8_e4m3 32x32 ue8m0 -> fp8_e4m3 32x32 fp32"]
