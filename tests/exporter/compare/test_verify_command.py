"""`b12x verify A B`: both packages replayed on the same inputs, everything they write compared."""

from __future__ import annotations

import hashlib
import json
import shutil
from types import SimpleNamespace

import pytest
import safetensors.torch
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.compare.package_verify import Tolerance, VerifyError, verify_packages
from b12x_toolchain.exporter.pipeline.package_writer import manifest_digest
from b12x_toolchain.runtime import load


def _verify(*args):
    return CliRunner().invoke(main, ["verify", *map(str, args)], terminal_width=200)


@pytest.fixture(scope="module")
def perturbed_path(small_path, tmp_path_factory):
    """The small package with one weight element nudged (file hash updated, so it loads)."""
    copy = shutil.copytree(small_path, tmp_path_factory.mktemp("perturbed") / "dsv41-small.b12x")
    weights = safetensors.torch.load_file(str(copy / "weights.safetensors"))
    weights["model.layers.0.self_attn.o_b_proj.weight"][7, 3] += 0.25
    data = safetensors.torch.save(dict(sorted(weights.items())), metadata={"format": "pt"})
    (copy / "weights.safetensors").write_bytes(data)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["weights.safetensors"] = hashlib.sha256(data).hexdigest()
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.fixture(scope="module")
def perturbed_pkg(perturbed_path):
    return load(perturbed_path)


def test_fused_and_unfused_replay_identically(small_pkg, small_unfused_path):
    checks = verify_packages(small_pkg, load(small_unfused_path), seed=3)
    # Every pass and rows bucket of the small recipe: 1, 2, 4 and 8 rows for each pass.
    assert [(c.pass_name, c.rows) for c in checks] == [
        (p, r) for p in ("prefill", "decode", "verify", "draft", "commit") for r in (1, 2, 4, 8)]
    assert all(c.replays == 1 and c.buffers > 0 for c in checks)
    assert [d for c in checks for d in c.differences] == []


def test_one_perturbed_weight_fails_naming_pass_and_buffer(structural_path, checkpoint_dir, perturbed_path):
    # The structural package with its weights bound from the checkpoint is the reference.
    result = _verify(structural_path, perturbed_path, "--weights", checkpoint_dir)
    assert result.exit_code == 1
    differing = [line for line in result.output.splitlines() if line.startswith("differs: ")]
    # Layer 0 runs in prefill, the first pass replayed: its logits and every cache after it move --
    # layer 1's paged compressed entries and index keys, and the drafter's window (from layer 1's output).
    assert differing[0].startswith("differs: prefill rows=1 trial 0: logits: ")
    for cache in ("cache.layer1.compressed", "cache.layer1.index", "cache.draft0.window"):
        assert any(line.startswith(f"differs: prefill rows=1 trial 0: {cache}: ") for line in differing), cache
    assert "buffer(s) differ between" in result.output
    assert "prefill" in result.output and "identical" not in result.output.split("prefill")[1].splitlines()[0]


def test_tolerance_accepts_what_bytes_refuse(small_pkg, perturbed_pkg):
    # (Byte for byte they differ: the test above.) Values within the tolerance pass, paged caches'
    # live pages decoded record by record like any other rows.
    loose = verify_packages(small_pkg, perturbed_pkg, tolerance=Tolerance(atol=1e6))
    assert [d for c in loose for d in c.differences] == []
    assert sum(c.replays for c in loose) == 20  # 5 passes x 4 rows buckets, one trial each


def test_packages_with_different_abis_are_refused(small_pkg):
    other = SimpleNamespace(abi_fingerprint="0" * 64)  # refused before anything of it is used
    with pytest.raises(VerifyError, match="ABIs differ"):
        verify_packages(small_pkg, other)
