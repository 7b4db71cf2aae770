"""Export refuses, by role and without a traceback, weights the model cannot compute with yet:
routed experts in fp8_e4m3 (the op set's expert linear takes packed FP4)."""

from __future__ import annotations

from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from recipe_text import TINY_TEXT


def test_fp8_routed_experts_are_refused_naming_the_role(tmp_path):
    path = tmp_path / "quantized.yaml"
    path.write_text(TINY_TEXT + "weights:\n  attention: {format: fp8_e4m3, block: [32, 32], scale: ue8m0}\n"
                    "  routed_experts: {format: fp8_e4m3, block: [32, 32], scale: ue8m0}\n")
    result = CliRunner().invoke(main, ["export", "--recipe", str(path), "--out", str(tmp_path / "out")],
                                terminal_width=300)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "weights.routed_experts: fp8_e4m3 32x32 ue8m0 experts have no expert op yet" in result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
