"""lower_for_inductor: the pass graph before and after, compared by node, and run eagerly to the same bytes.

The lowering is what the compiled replay hands Inductor. Run as a plain FX graph (no
Inductor) it must compute exactly what the package's graph computes: the references are
the ops' own implementations and a split write stores the same encoded records.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch

from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.ops.opset import RAW_BYTES, ops
from b12x_toolchain.runtime.session.compiled import REFERENCES, encode_rows, lower_for_inductor
from conftest import random_tokens

WRITES = {ops.write_rows.default: 5, ops.write_slots.default: 3}  # op -> fmt argument index
LISTED_OR_WINDOW = lambda node: node.args[4] is None or node.args[8] is not None  # noqa: E731


def _targets(graph) -> collections.Counter:
    return collections.Counter(n.target for n in graph.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("pass_name", ["prefill", "decode", "verify"])
def test_the_lowered_graph_differs_only_where_it_should(small_path, pass_name):
    program = load(small_path).passes[pass_name].program
    before = program.graph_module
    after = copy.deepcopy(before)
    counts = lower_for_inductor(after)

    nodes = [n for n in before.graph.nodes if n.op == "call_function"]
    attention = [n for n in nodes if n.target == ops.sparse_attention.default]
    pure = sum(n.target in (ops.round_trip.default, ops.gather_rows.default, ops.window_read.default,
                            ops.read_rows.default, ops.hc_sinkhorn.default) for n in nodes)
    encoding = [n for n in nodes if n.target in WRITES and n.args[WRITES[n.target]] != RAW_BYTES]
    assert counts == {"references": pure + sum(map(LISTED_OR_WINDOW, attention)), "split_writes": len(encoding)}
    assert counts["references"] > 0 and (pass_name == "verify" or counts["split_writes"] > 0)

    was, now = _targets(before), _targets(after)
    for op, (reference, _) in REFERENCES.items():
        assert now[op] == was[op] - (now[reference] - was[reference]), op  # each replaced node became its reference
    assert now[ops.sparse_attention.default] == len(attention) - sum(map(LISTED_OR_WINDOW, attention))
    assert now[encode_rows] == len(encoding)
    for node in after.graph.nodes:
        if node.target in WRITES:  # every write now copies encoded records, fed by the encoding
            assert node.args[WRITES[node.target]] == RAW_BYTES
    split = [n for n in after.graph.nodes if n.target in WRITES and n.args[1].target is encode_rows]
    assert len(split) == len(encoding)


def test_the_lowered_graphs_compute_the_same_bytes(small_path):
    package = load(small_path)
    plain, lowered = package.session(slots=2, max_rows=2), package.session(slots=2, max_rows=2)
    for name in ("prefill", "decode", "verify"):
        graph = copy.deepcopy(plain.buckets[name][2].graph)
        lower_for_inductor(graph)
        for bucket in lowered.buckets[name].values():
            bucket.graph = graph
    gen = torch.Generator().manual_seed(5)
    width = package.passes["prefill"].width
    prompts = [random_tokens(gen, width), random_tokens(gen, width - 5) + [0] * 5]  # the second: 5 invalid rows
    steps = [("prefill", {"token_ids": prompts, "slot_ids": [0, 1], "positions": [0, 0],
                          "new_tokens": [width, width - 5]}),
             ("decode", {"token_ids": [[7], [9]], "slot_ids": [0, 1], "positions": [width, width - 5], "new_tokens": [1, 1]}),
             ("verify", {"token_ids": [random_tokens(gen, 8), random_tokens(gen, 8)], "slot_ids": [0, 1],
                         "positions": [width + 1, width - 4]})]
    for name, values in steps:
        want = {k: v.clone() for k, v in plain.replay(name, **values).items()}
        got = lowered.replay(name, **values)
        for key in want:
            assert torch.equal(got[key], want[key]), (name, key)
        for cache in plain.caches:
            assert torch.equal(lowered.caches[cache], plain.caches[cache]), (name, cache)
        for stage in plain.staging:
            assert torch.equal(lowered.staging[stage], plain.staging[stage]), (name, stage)
