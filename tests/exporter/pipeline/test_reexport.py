"""Reproducible bytes and `b12x export --check`: re-export from the manifest, compare bytes.

(Another install, process and folder give the same bytes: test_coexistence exports the one-layer
recipe from a fresh venv, elsewhere, and compares it with the suite's own export.)"""

from __future__ import annotations

import io
import json
import shutil
import socket
import tempfile
import zipfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.pipeline.reexport import differences
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.runtime.package.checkpoint import INDEX
from paths import ROOT

pytestmark = pytest.mark.slow(minutes=0.35)


@pytest.fixture(scope="module")
def changed(small_recipe):
    """The small recipe with one value changed: RoPE's base, which every pass but commit reads."""
    return recipe_variant(small_recipe, {"model.rope_theta": 20000.0})


@pytest.fixture(scope="module")
def structural(changed, tmp_path_factory):
    # The changed recipe rather than the small one: the check of the small recipe's committed
    # manifest below re-exports the changed one, and so copies these captures (trace_cache.py).
    return export_package(changed, tmp_path_factory.mktemp("changed"), structural=True).path


def _texts(root: Path):
    """Every file's bytes, and every entry of every archive in it, decompressed."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            yield path.name, data
            if zipfile.is_zipfile(io.BytesIO(data)):
                archive = zipfile.ZipFile(io.BytesIO(data))
                for entry in archive.namelist():
                    yield f"{path.name}:{entry}", archive.read(entry)


def test_package_holds_no_paths_or_host_names(structural):
    forbidden = {str(ROOT), str(Path.home()), tempfile.gettempdir(), str(structural.parent), socket.gethostname()}
    for name, data in _texts(structural):
        for text in forbidden - {"", "/"}:
            assert text.encode() not in data, f"{name} contains {text!r}"


def test_check_passes_for_an_untouched_package(structural, tmp_path):
    copy = shutil.copytree(structural, tmp_path / "renamed.b12x")
    result = CliRunner().invoke(main, ["export", "--check", str(copy)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "re-export is byte-identical" in result.output
    assert "capturing verify" in result.output and "captured verify in" in result.output  # progress per pass


def test_differences_name_exactly_the_changed_file(structural, tmp_path):
    copy = shutil.copytree(structural, tmp_path / "copy.b12x")
    data = bytearray((copy / "graphs" / "draft.pt2").read_bytes())
    data[100] ^= 1
    (copy / "graphs" / "draft.pt2").write_bytes(bytes(data))
    assert differences(copy, structural) == ["graphs/draft.pt2"]
    (copy / "extra.txt").write_text("x")
    assert differences(copy, structural) == ["extra.txt", "graphs/draft.pt2"]


def test_check_of_a_manifest_names_what_a_recipe_change_moves(structural_path, small_recipe, changed, tmp_path):
    """CI keeps only the manifest; changing one recipe value must change the bytes, and say where."""
    committed = tmp_path / f"{small_recipe.name}.manifest.json"
    shutil.copy(structural_path / "manifest.json", committed)  # structural, with a checkpoint's checksums
    recipe = tmp_path / "changed.yaml"
    recipe.write_text(yaml.safe_dump(changed.normalized()))
    result = CliRunner().invoke(main, ["export", "--check", str(committed), "--recipe", str(recipe)])
    assert result.exit_code == 1
    differing = [line.removeprefix("differs: ") for line in result.output.splitlines() if line.startswith("differs: ")]
    # RoPE runs in prefill, decode, verify and draft; commit only copies bytes.
    assert differing == ["graphs/decode.pt2", "graphs/draft.pt2", "graphs/prefill.pt2", "graphs/verify.pt2",
                         "manifest.json (recipe, recipe_sha256)"]
    assert "is not byte-identical: 5 file(s) differ" in result.output


def test_check_refuses_settings_that_contradict_the_package(structural):
    result = CliRunner().invoke(main, ["export", "--check", str(structural), "--no-fuse"])
    assert result.exit_code == 1 and "--check re-exports with the settings PKG records" in result.output


def test_weights_index_must_hold_every_weight(checkpoint_dir, small_recipe, tmp_path):
    """The checkpoint holds the small recipe's weights: the small recipe is exported against its index."""
    recipe = tmp_path / "small.yaml"
    recipe.write_text(yaml.safe_dump(small_recipe.normalized()))
    index = json.loads((checkpoint_dir / INDEX).read_text())
    del index["weight_map"]["model.layers.1.self_attn.compressor.kv_proj.weight"]
    (tmp_path / INDEX).write_text(json.dumps(index))
    result = CliRunner().invoke(main, ["export", "--recipe", str(recipe), "--weights", "none",
                                       "--weights-index", str(tmp_path / INDEX), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "model.layers.1.self_attn.compressor.kv_proj.weight: not in the checkpoint index" in result.output
    assert not (tmp_path / "out").exists()  # refused before anything is captured
