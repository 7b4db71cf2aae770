"""Corrupted, tampered or hostile packages are refused by load(), and nothing in them runs."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest

from b12x_toolchain.exporter.pipeline.package_writer import manifest_digest
from b12x_toolchain.runtime import PackageError, load

FILES = ["manifest.json", "weights.safetensors", "graphs/prefill.pt2", "graphs/verify.pt2",
         "graphs/draft.pt2", "graphs/commit.pt2"]


@pytest.fixture
def pkg(fused_path, tmp_path):
    target = tmp_path / "pkg.b12x"
    shutil.copytree(fused_path, target)
    return target


def _resign(root: Path, edit) -> None:
    """Rewrite the manifest as an attacker who also fixes every hash would."""
    manifest = json.loads((root / "manifest.json").read_text())
    edit(manifest)
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))


def _rehash(root: Path, name: str) -> None:
    import hashlib

    digest = hashlib.sha256((root / name).read_bytes()).hexdigest()
    _resign(root, lambda m: m["files"].__setitem__(name, digest))


@pytest.mark.parametrize("name", FILES)
def test_truncated_file_is_refused(pkg, name):
    path = pkg / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(PackageError):
        load(pkg)


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("where", [0.0, 0.5, 0.999])
def test_flipped_byte_is_refused(pkg, name, where):
    path = pkg / name
    data = bytearray(path.read_bytes())
    index = int(where * (len(data) - 1))
    data[index] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(PackageError):
        load(pkg)


@pytest.mark.parametrize("name", FILES[1:])
def test_missing_file_is_refused(pkg, name):
    (pkg / name).unlink()
    with pytest.raises(PackageError, match=rf"{name}: listed in manifest.json but missing"):
        load(pkg)


def test_missing_manifest_is_refused(pkg):
    (pkg / "manifest.json").unlink()
    with pytest.raises(PackageError, match="no manifest.json"):
        load(pkg)


@pytest.mark.parametrize("extra", ["extra.bin", "graphs/extra.pt2"])
def test_extra_file_is_refused(pkg, extra):
    (pkg / extra).write_bytes(b"x")
    with pytest.raises(PackageError, match=f"{extra}: file is not listed"):
        load(pkg)


def test_symlinked_file_is_refused(pkg, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.move(pkg / "weights.safetensors", outside)
    os.symlink(outside, pkg / "weights.safetensors")
    with pytest.raises(PackageError, match="weights.safetensors: is a symbolic link"):
        load(pkg)


def test_symlinked_directory_is_refused(pkg, tmp_path):
    shutil.move(pkg / "graphs", tmp_path / "graphs")
    os.symlink(tmp_path / "graphs", pkg / "graphs")
    with pytest.raises(PackageError, match="graphs: is a symbolic link"):
        load(pkg)


@pytest.mark.parametrize("name", ["../escape.bin", "/etc/passwd", "graphs/../../escape.bin"])
def test_manifest_pointing_outside_is_refused(pkg, name):
    _resign(pkg, lambda m: m["files"].__setitem__(name, "0" * 64))
    with pytest.raises(PackageError, match="points outside the package"):
        load(pkg)


class _Payload:
    """Unpickling this creates a marker file: proof that code from the package ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(pkg: Path, graph: str, entry: str, marker: Path, config_entry: str | None = None) -> None:
    path = pkg / graph
    source = zipfile.ZipFile(io.BytesIO(path.read_bytes()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for info in source.infolist():
            body = source.read(info)
            if info.filename == entry:
                body = pickle.dumps(_Payload(marker))
            if config_entry and info.filename == config_entry:
                body = json.dumps({"config": {"w": {"path_name": "w.pt", "is_param": True}}}).encode()
            target.writestr(info, body)
        if entry not in source.namelist():
            target.writestr(entry, pickle.dumps(_Payload(marker)))
    path.write_bytes(out.getvalue())
    _rehash(pkg, graph)


@pytest.mark.parametrize("entry, config", [
    ("archive/data/sample_inputs/model.pt", None),
    ("archive/data/weights/w.pt", "archive/data/weights/model_weights_config.json"),
    ("archive/data/constants/c.pt", None),
])
def test_pickle_payload_in_a_graph_never_runs(pkg, tmp_path, entry, config):
    marker = tmp_path / "pwned"
    _plant(pkg, "graphs/verify.pt2", entry, marker, config)
    with pytest.raises(PackageError, match="graphs/verify.pt2: "):
        load(pkg)
    assert not marker.exists()
    # The planted archive really would have run the payload had anything unpickled it.
    pickle.loads(zipfile.ZipFile(pkg / "graphs" / "verify.pt2").read(entry))
    assert marker.exists()


def test_graph_calling_an_op_outside_the_op_set_is_refused(fused_pkg):
    import torch

    from b12x_toolchain.runtime.package.graph_archive import check_graph_ops

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.prims.convert_element_type.default, (x, torch.float16)))
    with pytest.raises(PackageError, match="calls prims.convert_element_type.default, which is outside op set v7"):
        check_graph_ops("graphs/verify.pt2", graph)
    check_graph_ops("graphs/verify.pt2", fused_pkg.passes["verify"].program.graph)  # the real graph passes


def test_not_a_directory_and_not_json(pkg, tmp_path):
    with pytest.raises(PackageError, match="not a package directory"):
        load(tmp_path / "nothing-here")
    (pkg / "manifest.json").write_text("{not json")
    with pytest.raises(PackageError, match="manifest.json: not valid JSON"):
        load(pkg)
