"""ruff over the whole repository, with pyproject's [tool.ruff] configuration: pyflakes (unused
imports and variables, undefined names) and import order. Run by the suite, so CI runs it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from paths import ROOT


def test_ruff_check_is_clean():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: it is in the dev extra (pip install -e '.[dev]')", pytrace=False)
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        pytest.fail(f"ruff check found problems (`ruff check --fix` mends the mechanical ones):\n"
                    f"{result.stdout}{result.stderr}", pytrace=False)
