"""Structural export: no weights in the package, the same graphs and ABI, weights bound at load."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from b12x_toolchain.exporter.pipeline.package_writer import manifest_digest
from b12x_toolchain.runtime import PackageError, load
from b12x_toolchain.runtime.package.checkpoint import INDEX
from b12x_toolchain.runtime.package.manifest import WeightTensor
from b12x_toolchain.runtime.package.reader import read_manifest

pytestmark = pytest.mark.slow(minutes=0.7)  # the module's time on two busy cores: longest runs first

GIB = 1 << 30


def test_structural_package_has_the_full_packages_graphs_and_abi(structural_path, small_path):
    structural, full = (json.loads((p / "manifest.json").read_text()) for p in (structural_path, small_path))
    graphs = {name for name in full["files"] if name.startswith("graphs/")}
    assert set(structural["files"]) == graphs  # no weights.safetensors
    # Captured on fake tensors by two worker processes, byte for byte what real weights give in one.
    for name in graphs:
        assert (structural_path / name).read_bytes() == (small_path / name).read_bytes(), name
    assert structural["abi_fingerprint"] == full["abi_fingerprint"]
    assert structural["format_version"] == "4.3"  # the small recipe has Engram
    tensors = structural["weights"]["tensors"]
    assert structural["weights"]["external"] is True
    embed = tensors["model.embed_tokens.weight"]
    assert embed == {"dtype": "float32", "shape": [512, 128], "sha256": embed["sha256"]}
    assert tensors["model.layers.0.mlp.gate.tid2eid"]["dtype"] == "int64"  # the hash-routing table
    assert all(len(t["sha256"]) == 64 for t in tensors.values())
    weight_inputs = {s["name"] for p in full["passes"].values() for s in p["inputs"] if s["role"] == "weight"}
    assert set(tensors) == weight_inputs


def test_unbound_structural_package_loads_but_does_not_run(structural_path):
    package = load(structural_path)
    assert package.external_weights and package.weights is None
    with pytest.raises(PackageError, match=r"weights are external and not bound; .*weights=CHECKPOINT_DIR"):
        package.session(slots=1)


def test_bound_checkpoint_replays_like_the_package_with_weights(structural_path, checkpoint_dir, small_pkg):
    package = load(structural_path, weights=checkpoint_dir)
    assert package.weights.keys() == small_pkg.weights.keys()
    assert all(torch.equal(package.weights[n], small_pkg.weights[n]) for n in package.weights)
    outputs = []
    for pkg in (package, small_pkg):
        session = pkg.session(slots=2, max_rows=2)
        session.replay("prefill", token_ids=[list(range(1, 65))], slot_ids=[1], positions=[0], new_tokens=[40])
        logits = session.replay("verify", token_ids=[[5] * 8], slot_ids=[1], positions=[40])["logits"].clone()
        outputs.append((logits, {n: c.clone() for n, c in session.caches.items()}))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert all(torch.equal(outputs[0][1][n], outputs[1][1][n]) for n in outputs[0][1])


def _edited_checkpoint(source, target, name, change):
    """A copy of the checkpoint with tensor `name` replaced by change(tensor)."""
    shutil.copytree(source, target)
    shard = target / json.loads((target / INDEX).read_text())["weight_map"][name]
    tensors = safetensors.torch.load_file(str(shard))
    tensors[name] = change(tensors[name]).contiguous()
    safetensors.torch.save_file(tensors, str(shard), metadata={"format": "pt"})
    return target


def test_load_rejects_a_missing_tensor_by_name(structural_path, checkpoint_dir, tmp_path):
    broken = shutil.copytree(checkpoint_dir, tmp_path / "ckpt")
    index = json.loads((broken / INDEX).read_text())
    del index["weight_map"]["model.layers.1.self_attn.compressor.gate_proj.weight"]
    (broken / INDEX).write_text(json.dumps(index))
    with pytest.raises(PackageError, match=r"^model\.layers\.1\.self_attn\.compressor\.gate_proj\.weight: not in the checkpoint$"):
        load(structural_path, weights=broken)


def test_load_rejects_a_misshapen_tensor_by_name(structural_path, checkpoint_dir, tmp_path):
    broken = _edited_checkpoint(checkpoint_dir, tmp_path / "ckpt", "model.layers.1.self_attn.q_a_proj.weight",
                                lambda t: t.T)
    with pytest.raises(PackageError, match=r"model\.layers\.1\.self_attn\.q_a_proj\.weight: shape \[128, 64\] in .* "
                                           r"does not match the package's \[64, 128\]"):
        load(structural_path, weights=broken)


def test_load_rejects_a_tensor_whose_bytes_changed(structural_path, checkpoint_dir, tmp_path):
    broken = _edited_checkpoint(checkpoint_dir, tmp_path / "ckpt", "mtp.0.self_attn.q_b_proj.weight", lambda t: t * 2)
    with pytest.raises(PackageError, match=r"mtp\.0\.self_attn\.q_b_proj\.weight: sha256 .* does not match the package's"):
        load(structural_path, weights=broken)


def test_manifest_weight_list_must_match_the_pass_inputs(structural_path, tmp_path):
    copy = shutil.copytree(structural_path, tmp_path / "copy.b12x")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["weights"]["tensors"]["model.embed_tokens.weight"]["shape"] = [512, 64]
    manifest["manifest_sha256"] = manifest_digest(manifest)  # a consistent edit, not corruption
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match=r"weights\.tensors\.model\.embed_tokens\.weight does not match the pass inputs"):
        load(copy)


@pytest.mark.slow
def test_full_size_structural_export(tmp_path):
    """Every pass of the full-size recipe on this CPU, without its 175 GiB of weights, from the CLI."""
    from b12x_toolchain.exporter.model.weights import weight_shapes
    from b12x_toolchain.exporter.recipe.dims import Dims
    from b12x_toolchain.exporter.recipe.loader import load_recipe

    proc = subprocess.run([sys.executable, "-m", "b12x_toolchain.exporter.cli.main", "export", "--recipe", "dsv41", "--weights", "none",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Largest child this test process has waited for: the export, unless an earlier one was larger.
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 < 4 * GIB
    for name in ("prefill", "verify", "draft", "commit"):  # progress per pass
        assert f"capturing {name} …" in proc.stdout and f"captured {name} in " in proc.stdout
    manifest = read_manifest(tmp_path / "dsv41.b12x")
    matches = {p: r["fuse_window_snapshot"].matches for p, r in manifest.rewrites.results.items()}
    assert matches == {"prefill": 0, "verify": 40, "draft": 3, "commit": 0}  # as the recipe expects
    assert sorted(manifest.files) == ["graphs/commit.pt2", "graphs/draft.pt2", "graphs/prefill.pt2", "graphs/verify.pt2"]
    tensors = manifest.weights.tensors
    # In the recipe's V4.1 release formats; no index: no checksums.
    assert tensors["model.embed_tokens.weight"] == WeightTensor("bfloat16", (129280, 5120))
    q = "model.layers.0.self_attn.q_a_proj.weight"  # [q_lora 1536, hidden 5120] in 32x32 blocks
    assert (tensors[q], tensors[q + "_scale"]) == (WeightTensor("float8_e4m3fn", (1536, 5120)),
                                                   WeightTensor("float8_e8m0fnu", (48, 160)))
    assert set(tensors) == set(weight_shapes(Dims.from_recipe(load_recipe("dsv41"))))
    assert manifest.passes["verify"].rows_buckets == (1, 2, 4, 8, 16, 32)
