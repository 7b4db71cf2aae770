"""The project card's `b12x export --recipe dsv41.yaml`, on a fresh install, in any directory.

In-process (`CliRunner`) to spare a torch import per command. Where the export itself is
not under test, `export_package` is replaced by a recorder: the full-size recipe's
structural export takes minutes.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import yaml
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.model import weights as weights_module
from b12x_toolchain.exporter.pipeline import export as export_module
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from conftest import SMALL
from decode_steps import FP32_WEIGHTS

BUNDLED = "dsv4-tiny, dsv41, dsv41-mini, dsv41-tiny"


@pytest.fixture
def recorded_exports(monkeypatch):
    """Replace export_package with a recorder; the list holds each call's keyword arguments."""
    calls = []

    def record(recipe, out_dir, **kwargs):
        calls.append({"recipe": recipe, **kwargs})
        return SimpleNamespace(path=out_dir / f"{recipe.name}.b12x", abi_fingerprint="0" * 64)

    monkeypatch.setattr(export_module, "export_package", record)
    return calls


@pytest.fixture
def small_yaml(tmp_path):
    """The 2-layer variant as a user's YAML file, outside the working directory."""
    path = tmp_path / "recipes" / "small.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(recipe_variant(load_recipe("dsv41-tiny"), SMALL, "dsv41-small").normalized()))
    return path


def export(*args):
    return CliRunner().invoke(main, ["export", *map(str, args)], terminal_width=200)


def error_line(result) -> str:
    """The one `error:` line a failed command prints, with exit code 1 and no traceback."""
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_card_command_uses_the_bundled_recipe_structurally(tmp_path, monkeypatch, recorded_exports):
    monkeypatch.chdir(tmp_path)
    result = export("--recipe", "dsv41.yaml")
    assert result.exit_code == 0, result.output
    assert "dsv41.yaml: no such file; using the bundled recipe dsv41\n" in result.stderr
    # 364 GiB of random weights in the V4.1 release's formats exceeds any test machine's default budget.
    assert "dsv41: random weights take 364.2 GiB, over the budget of" in result.stderr
    assert "exporting structurally" in result.stderr
    [call] = recorded_exports
    assert call["recipe"].name == "dsv41" and call["structural"] and call["weights"] is None


def test_missing_tiny_yaml_falls_back_to_the_bundled_recipe_with_random_weights(tmp_path, monkeypatch,
                                                                                 recorded_exports):
    monkeypatch.chdir(tmp_path)
    result = export("--recipe", "dsv41-tiny.yaml")
    assert result.exit_code == 0, result.output
    assert result.stderr == "dsv41-tiny.yaml: no such file; using the bundled recipe dsv41-tiny\n"
    [call] = recorded_exports
    # As before the budget existed: a tiny recipe's random weights are drawn and stored.
    assert call["recipe"] == load_recipe("dsv41-tiny") and not call["structural"]


def test_an_existing_file_wins_over_the_bundled_name(tmp_path, small_yaml, monkeypatch, recorded_exports):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dsv41-tiny.yaml").write_text(small_yaml.read_text())
    assert export("--recipe", "dsv41-tiny.yaml").stderr == ""
    # The same name where no such file is falls back, saying so.
    monkeypatch.chdir(small_yaml.parent)
    assert "using the bundled recipe dsv41-tiny" in export("--recipe", "dsv41-tiny.yaml").stderr
    assert [c["recipe"].name for c in recorded_exports] == ["dsv41-small", "dsv41-tiny"]


def test_an_unknown_recipe_lists_the_bundled_ones_and_writes_nothing(tmp_path, monkeypatch, recorded_exports):
    monkeypatch.chdir(tmp_path)
    for source in ("dsv99.yaml", "dsv99", "sub/dsv41.yaml"):  # only a bare NAME.yaml falls back
        line = error_line(export("--recipe", source))
        assert line.startswith(f"error: {source}: ") and line.endswith(BUNDLED)
    assert recorded_exports == [] and list(tmp_path.iterdir()) == []


def test_full_size_weights_are_sized_without_allocating(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("sizing allocated a tensor")

    for name in ("randn", "rand", "empty", "zeros", "ones"):
        monkeypatch.setattr(torch, name, refuse)
    dims = Dims.from_recipe(recipe_variant(load_recipe("dsv41"), FP32_WEIGHTS))  # float32, as before formats
    started = time.perf_counter()
    size = weights_module.random_weight_bytes(dims)
    assert time.perf_counter() - started < 2.0
    parameters = sum(torch.Size(s).numel() for s in weights_module.weight_shapes(dims).values())
    assert 100e9 < parameters < 1e12 and 4 * parameters <= size <= 8 * parameters  # float32, a few int64
    assert 400e9 < size  # hundreds of GB
    native = weights_module.random_weight_bytes(Dims.from_recipe(load_recipe("dsv41")))
    # The release's formats: about 1.1 bytes a parameter, 1.03 in Engram's FP8 tables (a third of the model).
    assert 0.16 * size < native < 0.2 * size


def test_size_matches_the_weights_init_draws():
    dims = Dims.from_recipe(load_recipe("dsv4-tiny"))  # has int64 hash-routing tables
    drawn = weights_module.init_weights(dims, seed=0)
    assert weights_module.random_weight_bytes(dims) == sum(t.nbytes for t in drawn.values())


def test_weights_over_the_budget_export_structurally(tmp_path, small_yaml, monkeypatch, recorded_exports):
    """The command's choice; what a structural export writes is test_structural's."""
    monkeypatch.chdir(tmp_path)
    result = export("--recipe", small_yaml, "--max-weight-bytes", 1000, "--out", "pkgs")
    assert result.exit_code == 0, result.output
    notes = [l for l in result.stderr.splitlines() if "over the budget" in l]
    assert notes == [notes[0]] and "dsv41-small: random weights take 4.7 MiB, over the budget of 1000 bytes " \
                                  "(--max-weight-bytes); exporting structurally" in notes[0]
    [call] = recorded_exports
    assert call["recipe"].name == "dsv41-small" and call["structural"] and call["weights"] is None
    assert "external weights" in result.stdout


def test_random_weights_over_the_budget_stop_before_allocating(tmp_path, small_yaml, monkeypatch):
    monkeypatch.setattr(export_module, "init_weights", lambda *a, **k: pytest.fail("weights were drawn"))
    monkeypatch.chdir(tmp_path)
    line = error_line(export("--recipe", small_yaml, "--weights", "init", "--max-weight-bytes", 1000))
    assert line.startswith("error: dsv41-small: random weights take 4.7 MiB, over the budget of 1000 bytes")
    for option in ("--weights none", "--checkpoint DIR", "--max-weight-bytes"):
        assert option in line
    assert list(tmp_path.iterdir()) == [small_yaml.parent]
