"""The dependency rule: runtime imports neither passes nor exporter; passes not exporter."""

from __future__ import annotations

import ast
import subprocess
import sys
from paths import ROOT

FORBIDDEN = {"runtime": ("b12x_toolchain.exporter", "b12x_toolchain.passes"), "passes": ("b12x_toolchain.exporter",)}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_forbidden_imports_in_source():
    offenders = []
    for folder, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            offenders += [f"{folder}/{path.name}: {name}" for name in _imports(path) if name.startswith(forbidden)]
    assert offenders == []


def test_loading_a_package_pulls_in_no_exporter_code(fused_path):
    code = (
        "import sys; from b12x_toolchain.runtime import load; from b12x_toolchain.runtime.serving.speculative import Decoder;"
        f"Decoder(load({str(fused_path)!r}).session(slots=1)).generate([[1, 2]], 2);"
        "bad = sorted(m for m in sys.modules if m.startswith(('b12x_toolchain.exporter', 'b12x_toolchain.passes')));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
