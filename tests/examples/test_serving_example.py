"""examples/serving_loop.py runs: more requests than slots, every one finished."""

from __future__ import annotations

import runpy
import sys

import pytest

from paths import ROOT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_example_serving_loop_runs(fused_path, capsys, monkeypatch):
    # In-process, so the module's one-thread setting applies (a subprocess would contend).
    monkeypatch.setattr(sys, "argv", ["serving_loop.py", str(fused_path)])
    runpy.run_path(str(ROOT / "examples" / "serving_loop.py"), run_name="__main__")
    out = capsys.readouterr().out
    finished = [line for line in out.splitlines() if line.startswith("r") and " -> [" in line]
    assert len(finished) == 10 and "prompt of 200 tokens" in out
    assert "'slot_reuse': 6" in out and "'retired': 10" in out
