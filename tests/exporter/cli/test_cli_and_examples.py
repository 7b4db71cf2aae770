"""The command line and the example a server author starts from."""

from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from paths import ROOT


def test_inspect_shows_passes_abi_rewrites_and_files(small_path, small_pkg):
    result = CliRunner().invoke(main, ["inspect", str(small_path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert small_pkg.abi_fingerprint in result.output
    for text in ("pass verify: width 8", "pass draft: width 7", "staging.verify.layer0.window",
                 "fuse_window_snapshot", "graphs/verify.pt2", "weights.safetensors"):
        assert text in result.output


def test_run_generates_tokens(small_path):
    result = CliRunner().invoke(main, ["run", str(small_path), "--prompt-ids", "1,2,3", "--max-new-tokens", "9"],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    tokens = result.output.split("tokens: ")[1].splitlines()[0].split()
    assert len(tokens) == 9 and all(t.isdigit() for t in tokens)
    assert "acceptance_rate" in result.output


def test_run_refuses_bad_prompt_ids(small_path):
    result = CliRunner().invoke(main, ["run", str(small_path), "--prompt-ids", "1,x"])
    assert result.exit_code != 0 and "not a list of integer token ids" in result.output
    result = CliRunner().invoke(main, ["run", str(small_path), "--prompt-ids", "99999"])
    assert result.exit_code == 1 and "tokens: value 99999 is out of range" in result.output


def test_export_reports_a_bad_recipe_with_file_line_and_key(tmp_path):
    recipe = tmp_path / "bad.yaml"
    text = (ROOT / "recipes" / "dsv41-tiny.yaml").read_text().replace("verify: {width: 8", "verify: {width: 0")
    recipe.write_text(text)
    line = next(i for i, l in enumerate(text.splitlines(), 1) if "verify: {width: 0" in l)
    result = CliRunner().invoke(main, ["export", "--recipe", str(recipe), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert f"bad.yaml:{line}: passes.verify.width" in result.output
    assert not (tmp_path / "out").exists()


def test_export_prints_the_rewrite_table(small_recipe, tmp_path):
    import yaml

    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(small_recipe.normalized()))
    result = CliRunner().invoke(main, ["export", "--recipe", str(path), "--out", str(tmp_path)], terminal_width=200)
    assert result.exit_code == 0, result.output
    verify_row = next(l for l in result.output.splitlines() if "verify" in l and "fuse_window_snapshot" in l)
    assert verify_row.split("│")[3].strip() == "2"  # matches column
    assert (tmp_path / "dsv41-small.b12x" / "manifest.json").is_file()


def test_example_runtime_loader_runs(small_path):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "runtime_loader.py"), str(small_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "prompt of 139 tokens" in result.stdout and "stats:" in result.stdout
