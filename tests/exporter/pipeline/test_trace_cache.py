"""A process that exports a pass again copies its first trace: same bytes, fused or not, no trace.

The test suite itself exports with traces reused (tests/conftest.py), so every test here
states the setting it needs instead of relying on it.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch

from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.pipeline import trace_cache
from b12x_toolchain.exporter.pipeline.pass_export import PassJob, export_pass
from b12x_toolchain.exporter.recipe.dims import Dims

pytestmark = pytest.mark.slow(minutes=0.2)
REWRITES = ["fuse_window_snapshot"]


@pytest.fixture
def reusing(monkeypatch):
    # An empty cache of the test's own: the traces this worker keeps for the rest of the suite stay.
    monkeypatch.setattr(trace_cache, "_entries", OrderedDict())
    monkeypatch.setattr(trace_cache, "_enabled", [True])
    yield trace_cache.counts


def _job(recipe, name, rewrites=REWRITES, weights=None):
    return PassJob(recipe, name, rewrites, weights, None)


def _counted(job):
    before = dict(trace_cache.counts)
    graph = export_pass(job).graph
    return graph, {k: trace_cache.counts[k] - before[k] for k in before}


def test_a_second_export_of_a_pass_copies_the_trace_and_writes_the_same_bytes(one_layer_recipe, reusing):
    # draft has a window-snapshot site in the one-layer recipe, so its fused and unfused graphs differ.
    with trace_cache.tracing_every_time():
        fresh_fused = export_pass(_job(one_layer_recipe, "draft")).graph
        fresh_unfused = export_pass(_job(one_layer_recipe, "draft", [])).graph
    assert fresh_fused != fresh_unfused
    first, counted = _counted(_job(one_layer_recipe, "draft"))
    assert counted == {"hits": 0, "misses": 1} and first == fresh_fused
    # The first export's rewrites changed its own program, not the one kept.
    unfused, counted = _counted(_job(one_layer_recipe, "draft", []))
    assert counted == {"hits": 1, "misses": 0} and unfused == fresh_unfused
    again, counted = _counted(_job(one_layer_recipe, "draft"))
    assert counted == {"hits": 1, "misses": 0} and again == fresh_fused


def test_weights_of_other_values_share_a_trace_and_other_shapes_or_fakes_do_not(one_layer_recipe, reusing):
    d = Dims.from_recipe(one_layer_recipe)
    seeded = {seed: init_weights(d, seed) for seed in (0, 1)}
    _, counted = _counted(_job(one_layer_recipe, "commit", weights=seeded[0]))
    assert counted["misses"] == 1
    _, counted = _counted(_job(one_layer_recipe, "commit", weights=seeded[1]))
    assert counted == {"hits": 1, "misses": 0}
    # Structural (fake) weights are traced on their own, so a test comparing the two compares two traces.
    _, counted = _counted(_job(one_layer_recipe, "commit"))
    assert counted == {"hits": 0, "misses": 1}
    key = trace_cache.trace_key(d, "commit", None, seeded[0])
    other = {**seeded[0], "model.norm.weight": seeded[0]["model.norm.weight"].to(torch.float64)}
    assert trace_cache.trace_key(d, "commit", None, other) != key
    assert trace_cache.trace_key(d, "commit", 1, seeded[0]) != key
    assert trace_cache.trace_key(d, "verify", None, seeded[0]) != key


def test_off_by_default_and_off_inside_tracing_every_time(one_layer_recipe, reusing):
    with trace_cache.tracing_every_time():
        _, counted = _counted(_job(one_layer_recipe, "commit"))
    assert counted == {"hits": 0, "misses": 0} and not trace_cache._entries
    trace_cache.reuse_traces(False)
    _, counted = _counted(_job(one_layer_recipe, "commit"))
    assert counted == {"hits": 0, "misses": 0} and not trace_cache._entries


def test_a_copy_keeps_node_names_fx_would_rename():
    # Captured passes hold nodes named after Python keywords (`and`, as the dsv41 commit
    # graph does); fx's own copy renames them, and names are part of the package's bytes.
    class Both(torch.nn.Module):
        def forward(self, x):
            return (x > 0) & (x < 1)

    program = torch.export.export(Both(), (torch.zeros(3),))
    (node,) = [n for n in program.graph.nodes if n.name.startswith("and")]
    node.name = "and"
    names = [n.name for n in program.graph.nodes]
    assert [n.name for n in copy.deepcopy(program).graph.nodes] != names
    assert [n.name for n in trace_cache.copy_program(program).graph.nodes] == names
