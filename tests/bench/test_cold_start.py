"""The cold_start benchmark's child process reports its phases, on either loading path.

The children load the suite's shared one-layer package (one layer of each op kind), not the
tiny one the benchmark exports: the phases and both loading paths are the same code on any
package, and the old path's torch.export.load of every pass, nearly all of these tests' time,
grows with the layers (its child takes 14 s of CPU on the one-layer package, 20 s on the
two-layer small one).
Never asserts a speed — a benchmark's numbers depend on the machine.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow(minutes=0.3)


@pytest.mark.parametrize("path", ["old", "new"])
def test_a_session_child_reports_every_phase(one_layer_path, path):
    from benchmarks import cold_start
    from benchmarks.registry import REGISTRY

    assert REGISTRY["cold_start"] is cold_start.run
    phases = cold_start._child("session", one_layer_path, path)
    assert set(phases) == {"import", "load", "session", "first_token", "after_torch", "after_torch_cpu"}
    assert all(value > 0 for value in phases.values())
    assert phases["after_torch"] < phases["import"] + phases["load"] + phases["session"] + phases["first_token"]


def test_a_run_child_reports_wall_and_cpu_time_after_torch(one_layer_path):
    from benchmarks import cold_start

    phases = cold_start._child("run", one_layer_path, "new")
    assert set(phases) == {"import", "command", "after_torch", "after_torch_cpu"}
    assert all(value > 0 for value in phases.values())
