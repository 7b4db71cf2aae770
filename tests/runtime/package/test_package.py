"""Package ABI, reproducibility, and what load() refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from b12x_toolchain.runtime import PackageError, load

pytestmark = pytest.mark.slow(minutes=0.3)


def test_fused_and_unfused_share_the_abi_fingerprint(fused_pkg, unfused_pkg):
    assert fused_pkg.abi_fingerprint == unfused_pkg.abi_fingerprint
    assert fused_pkg.manifest.passes["verify"].inputs == unfused_pkg.manifest.passes["verify"].inputs
    # ...while the graphs themselves differ.
    assert fused_pkg.manifest.files["graphs/verify.pt2"] != unfused_pkg.manifest.files["graphs/verify.pt2"]


def test_manifest_records_what_the_abi_says(fused_pkg, tiny_recipe):
    m = fused_pkg.manifest
    assert m.format_version == "4.3" and m.opset_version == 7
    assert m.recipe_sha256 == tiny_recipe.sha256()
    assert m.passes["verify"].width == 8 and m.passes["draft"].width == 7
    assert m.passes["verify"].rows_buckets == (1, 2, 4, 8)
    assert set(m.files) == {"graphs/prefill.pt2", "graphs/verify.pt2", "graphs/draft.pt2",
                               "graphs/commit.pt2", "graphs/decode.pt2", "weights.safetensors"}
    assert {"torch", "b12x", "safetensors", "flashinfer_pin"} <= set(m.versions)
    text = json.dumps(m.to_json())
    assert "/tmp" not in text and str(Path.home()) not in text  # no absolute paths


@pytest.fixture
def copy_of(fused_path, tmp_path):
    target = tmp_path / "copy.b12x"
    shutil.copytree(fused_path, target)
    return target


def _edit_manifest(root: Path, edit, resign: bool = True) -> None:
    """Edit the manifest like a deliberate tamperer would: re-computing its own digest."""
    from b12x_toolchain.exporter.pipeline.package_writer import manifest_digest

    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    if resign:
        manifest["manifest_sha256"] = manifest_digest(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_load_refuses_a_manifest_edited_without_its_digest(copy_of):
    _edit_manifest(copy_of, lambda m: m["passes"]["verify"].update(rows_buckets=[1, 2, 4, 9]), resign=False)
    with pytest.raises(PackageError, match="manifest_sha256 does not match its contents"):
        load(copy_of)


def test_load_refuses_a_file_whose_hash_differs(copy_of):
    weights = copy_of / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(PackageError, match=r"weights\.safetensors: sha256 .* does not match"):
        load(copy_of)


def test_loaded_weights_view_the_one_buffer_their_file_was_read_and_hashed_into(fused_path):
    """No copy of the weights at load: every bound tensor is a view of the file's bytes as read."""
    package = load(fused_path)
    size = (Path(fused_path) / "weights.safetensors").stat().st_size
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in package.weights.values()}
    assert storages == {(next(iter(storages))[0], size)}


def test_load_refuses_a_newer_format_major(copy_of):
    _edit_manifest(copy_of, lambda m: m.update(format_version="5.0"))
    with pytest.raises(PackageError, match=r"format_version 5\.0 is not supported .*reads 4\.0 to 4\.4"):
        load(copy_of)


def test_load_refuses_a_newer_minor_and_an_older_major(copy_of):
    _edit_manifest(copy_of, lambda m: m.update(format_version="4.5"))
    with pytest.raises(PackageError, match="format_version 4.5"):
        load(copy_of)
    # Format 1 recorded no buffer data: such a package is re-exported, not guessed at.
    _edit_manifest(copy_of, lambda m: m.update(format_version="1.1"))
    with pytest.raises(PackageError, match=r"format_version 1\.1 is older .*re-export it with this version of b12x"):
        load(copy_of)


def test_load_refuses_an_unknown_opset(copy_of):
    _edit_manifest(copy_of, lambda m: m.update(opset_version=8))
    with pytest.raises(PackageError, match="opset_version 8 is unknown"):
        load(copy_of)


def test_load_refuses_missing_and_extra_files(copy_of):
    (copy_of / "notes.txt").write_text("hello")
    with pytest.raises(PackageError, match="notes.txt: file is not listed"):
        load(copy_of)
    (copy_of / "notes.txt").unlink()
    (copy_of / "graphs" / "draft.pt2").unlink()
    with pytest.raises(PackageError, match=r"graphs/draft\.pt2: listed in manifest.json but missing"):
        load(copy_of)


def test_load_refuses_a_path_outside_the_package(copy_of):
    def escape(m):
        m["files"]["../outside.bin"] = m["files"].pop("weights.safetensors")
        m["weights"]["file"] = "../outside.bin"
    _edit_manifest(copy_of, escape)
    with pytest.raises(PackageError, match=r"points outside the package"):
        load(copy_of)
