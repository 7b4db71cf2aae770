"""The CI re-export example: its script parses, its committed fingerprints are real manifests."""

from __future__ import annotations

import subprocess

from b12x_toolchain.exporter.recipe.loader import bundled_recipes
from b12x_toolchain.runtime.package.reader import read_manifest
from paths import EXAMPLES

CI = EXAMPLES / "ci"


def test_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(CI / "reexport.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_bundled_recipe_has_a_structural_fingerprint():
    for recipe in bundled_recipes():
        manifest = read_manifest(CI / "fingerprints" / f"{recipe}.manifest.json")  # versions and ABI checked
        assert manifest.name == recipe
        assert manifest.weights.external is True
        assert not any(name.startswith("weights") for name in manifest.files)
