"""A package exported on the CPU replays on another device once its graph is retargeted.

The meta device stands in for a GPU: like CUDA it is not the CPU the graphs were exported
on, and every op of the set has a meta (fake) implementation, so a pass graph runs on it.
"""

from __future__ import annotations

import pytest

from b12x_toolchain.runtime.session.retarget import graph_on


def _meta_args(session, pass_name):
    return [a.to("meta") for a in session.bucket_for(pass_name, 1).args]


def _devices(module):
    return {str(n.kwargs["device"]) for n in module.graph.nodes if n.op == "call_function" and "device" in n.kwargs}


def test_exported_graphs_carry_the_export_device(fused_pkg):
    # Why retargeting exists: without it a GPU session would run CPU-bound nodes.
    assert _devices(fused_pkg.passes["verify"].program.graph_module) == {"cpu"}


def test_cpu_sessions_use_the_package_graph_itself(fused_pkg):
    program = fused_pkg.passes["verify"].program
    assert graph_on(program, "cpu") is program.graph_module


@pytest.mark.parametrize("pass_name", ["verify", "draft", "commit"])
def test_retargeted_graph_runs_on_another_device(fused_pkg, pass_name):
    session = fused_pkg.session(slots=1, max_rows=1)
    program = fused_pkg.passes[pass_name].program
    module = graph_on(program, "meta")
    assert _devices(module) == {"meta"}
    outputs = module(*_meta_args(session, pass_name))
    expected = session.bucket_for(pass_name, 1).outputs
    assert [tuple(o.shape) for o in outputs] == [tuple(t.shape) for t in expected.values()]
    assert all(o.device.type == "meta" for o in outputs)
    # The package's own graph is untouched, and cannot run there.
    assert _devices(program.graph_module) == {"cpu"}
    with pytest.raises(Exception):
        program.graph_module(*_meta_args(session, pass_name))
