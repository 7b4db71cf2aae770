"""lower_for_inductor: the graph before, the graph expected after, compared by structure, and
the lowered graph run eagerly to the same bytes as the unrewritten one.

The lowering is what the compiled replay hands Inductor. Run as a plain FX graph (no
Inductor) it must compute exactly what the package's graph computes: the references are
the ops' own implementations and a split write stores the same encoded records. A toy
layer shows each rule on its own (before module, expected module); the package's graphs
show the rules' conditions on every node a real pass has.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch

from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.ops.namespace import NAMESPACE
from b12x_toolchain.runtime.ops.opset import RAW_BYTES, gather_rows, ops, round_trip, window_read
from b12x_toolchain.runtime.rewrite import RewriteResult, named_args
from b12x_toolchain.runtime.session.code_string_arguments import TWIN_NAMESPACE, code, coded_arguments
from b12x_toolchain.runtime.session.compiled import lower_for_inductor
from b12x_toolchain.runtime.session.reference_ops import INLINE_REFERENCES
from b12x_toolchain.runtime.session.split_encoding_writes import encode_rows
from conftest import random_tokens
from passes.layer_graphs import DIM, FMT, HISTORY, ROWS, SLOTS, TOKENS, WIDTH, export, ring, staging, structure

WRITES = (ops.write_rows.default, ops.write_slots.default)
REFERENCES = {rule.op: rule.to for rule in INLINE_REFERENCES.rules}


def _targets(graph) -> collections.Counter:
    return collections.Counter(n.target for n in graph.graph.nodes if n.op == "call_function")


# ----------------------------------------------------------------------------- one layer


class Layer(torch.nn.Module):
    """Before: an encoding write, a write of records already encoded, and three pure reads."""

    def forward(self, ring, staging, kv, row_ids, index, valid, records):
        ops.write_rows(ring, kv, row_ids, index, valid, FMT)
        ops.write_rows(ring, records, row_ids, index, valid, RAW_BYTES)
        history = ops.gather_rows(ring, row_ids, index, DIM, FMT)
        return history, ops.round_trip(kv, FMT), ops.window_read(staging, TOKENS, DIM, FMT)


class LayerLowered(torch.nn.Module):
    """Expected after: the encoding in the graph, the write copying bytes, the reads as references."""

    def forward(self, ring, staging, kv, row_ids, index, valid, records):
        ops.write_rows.default(ring, encode_rows(kv, FMT), row_ids, index, valid, RAW_BYTES)
        ops.write_rows.default(ring, records, row_ids, index, valid, RAW_BYTES)
        history = gather_rows(ring, row_ids, index, DIM, FMT)
        return history, round_trip(kv, FMT), window_read(staging, TOKENS, DIM, FMT)


def layer_inputs(gen: torch.Generator | None = None) -> tuple:
    gen = gen or torch.Generator().manual_seed(0)
    values = torch.randn(ROWS, WIDTH, DIM, generator=gen) * 4
    # Distinct rows and positions: a write hits each cache row at most once.
    row_ids = torch.randperm(SLOTS, generator=gen)[:ROWS].int()
    index = torch.stack([torch.randperm(HISTORY, generator=gen)[:WIDTH] for _ in range(ROWS)])
    return (ring(), staging(), values, row_ids, index, torch.rand(ROWS, WIDTH, generator=gen) < 0.7,
            encode_rows(torch.randn(ROWS, WIDTH, DIM, generator=gen), FMT))


def traced(module: torch.nn.Module) -> torch.fx.GraphModule:
    """The expected module as a graph: the references and the encoding stay calls, as the lowering leaves them."""
    tracer = torch.fx.Tracer(autowrap_functions=(encode_rows, gather_rows, round_trip, window_read))
    return torch.fx.GraphModule(module, tracer.trace(module))


def test_the_lowering_gives_the_expected_graph():
    gm = export(Layer(), *layer_inputs())
    results = lower_for_inductor(gm)
    assert results == [RewriteResult("inline_references", True, 3, 5, 5),
                       RewriteResult("split_encoding_writes", True, 1, 5, 6)]
    assert structure(gm) == structure(traced(LayerLowered()))


def test_the_lowered_layer_computes_the_same_bytes():
    unrewritten, lowered = export(Layer(), *layer_inputs()), export(Layer(), *layer_inputs())
    lower_for_inductor(lowered)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        inputs = layer_inputs(gen)
        a, b = [t.clone() for t in inputs], [t.clone() for t in inputs]
        want, got = unrewritten(*a), lowered(*b)
        assert all(torch.equal(x, y) for x, y in zip(want, got))
        assert all(torch.equal(x, y) for x, y in zip(a, b))  # the ring, written twice
        assert not torch.equal(a[0], inputs[0])  # the writes did write


# ----------------------------------------------------------------------------- the package's graphs


@pytest.mark.parametrize("pass_name", ["prefill", "decode", "verify"])
def test_the_lowered_graph_differs_only_where_it_should(small_path, pass_name):
    program = load(small_path).passes[pass_name].program
    before = program.graph_module
    after = copy.deepcopy(before)
    references, splits = lower_for_inductor(after)

    nodes = [n for n in before.graph.nodes if n.op == "call_function"]
    attention = [n for n in nodes if n.target == ops.sparse_attention.default]
    pure = sum(n.target in (ops.round_trip.default, ops.gather_rows.default, ops.window_read.default,
                            ops.read_rows.default, ops.hc_sinkhorn.default) for n in nodes)
    encoding = [n for n in nodes if n.target in WRITES and named_args(n)["fmt"] != RAW_BYTES]
    assert (references.matches, splits.matches) == (pure, len(encoding))
    assert references.matches > 0 and (pass_name == "verify" or splits.matches > 0)
    assert splits.nodes_after - references.nodes_before == len(encoding)  # one encoding node per split write

    was, now = _targets(before), _targets(after)
    for op, reference in REFERENCES.items():
        assert now[op] == was[op] - (now[reference] - was[reference]), op  # each replaced node became its reference
    assert now[ops.sparse_attention.default] == len(attention) > 0  # kept: its order over keys is fixed (reference_ops.py)
    assert now[encode_rows] == len(encoding)
    for node in after.graph.nodes:
        if node.target in WRITES:  # every write now copies encoded records, fed by the encoding
            assert named_args(node)["fmt"] == RAW_BYTES
    split = [n for n in after.graph.nodes if n.target in WRITES and named_args(n)["values"].target is encode_rows]
    assert len(split) == len(encoding)


def test_for_the_cpu_every_string_or_list_argument_is_coded(small_path):
    """The C++ wrapper calls an op through the C shim only without str or int[] arguments
    (code_string_arguments.py): lowered for the CPU, no call of the op set takes one, each
    such call is one of its twin's with the same arguments but those, coded."""
    before = load(small_path).passes["decode"].program.graph_module
    after = copy.deepcopy(before)
    *_, coded = lower_for_inductor(after, cpu=True)
    assert [r.name for r in lower_for_inductor(copy.deepcopy(before))] == ["inline_references", "split_encoding_writes"]
    calls = [n for n in after.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    twins = [n for n in calls if n.target.namespace == TWIN_NAMESPACE]
    assert coded.name == "code_string_arguments" and coded.matches == len(twins) > 0
    assert [n.name for n in calls if n.target.namespace == NAMESPACE and coded_arguments(n.target)] == []
    assert {n.target.name().split("::")[1] for n in twins} >= {"write_rows", "sparse_attention", "engram_hash"}
    for node in twins:
        args = named_args(node)
        for name in ("fmt", "layout", "multipliers", "primes"):
            if name in args:
                assert isinstance(args[name], int), (node.name, name)
    assert code(RAW_BYTES) in {named_args(n).get("fmt") for n in twins}  # the split writes' format


@pytest.mark.parametrize("cpu", [False, True], ids=["references", "coded"])
def test_the_lowered_graphs_compute_the_same_bytes(small_path, cpu):
    package = load(small_path)
    plain, lowered = package.session(slots=2, max_rows=2), package.session(slots=2, max_rows=2)
    for name in ("prefill", "decode", "verify"):
        graph = copy.deepcopy(plain.buckets[name][2].graph)
        lower_for_inductor(graph, cpu=cpu)
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
