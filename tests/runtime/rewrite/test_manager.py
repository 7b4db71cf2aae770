"""The kit's rewrite manager: rewrite results, invariant checks after every rewrite, and error naming."""

from __future__ import annotations

import pytest
import torch

import b12x_toolchain.runtime.ops.opset  # noqa: F401  (registers the b12x op set)
from b12x_toolchain.passes.fuse_window_snapshot import FUSE_WINDOW_SNAPSHOT
from b12x_toolchain.passes.pipeline import rewrites_named
from b12x_toolchain.runtime.rewrite import Rewrite, RewriteError, RewriteResult, run_rewrites
from b12x_toolchain.runtime.rewrite.invariants import check_invariants, signature
from passes.layer_graphs import (
    DIM,
    FMT,
    HISTORY,
    LAYOUT,
    PAGE,
    ROWS,
    TOKENS,
    WIDTH,
    layer_inputs,
    ops,
)

GRAPH = "verify"  # the graph name every failure message must carry


# An op in our namespace that op set v7 does not list: a graph using it must be
# refused, since no server implements it.
@torch.library.custom_op("b12x_toolchain::not_in_opset", mutates_args=())
def not_in_opset(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


not_in_opset.register_fake(lambda x: torch.empty_like(x))


class Layer(torch.nn.Module):
    """One staged window layer with two outputs (history and whole window)."""

    def forward(self, ring, staging, kv, row_ids, positions):
        ops.window_snapshot(ring, staging, row_ids, positions, HISTORY, LAYOUT, PAGE)
        ops.cache_append(staging, kv, HISTORY, LAYOUT, PAGE, FMT)
        return ops.window_read(staging, TOKENS, DIM, FMT), ops.window_read(staging, HISTORY, DIM, FMT)


def layer_graph() -> torch.fx.GraphModule:
    return torch.export.export(Layer(), layer_inputs(), strict=False).graph_module


def find(gm: torch.fx.GraphModule, op: str, target=None) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.op == op and (target is None or n.target == target))


# ----------------------------------------------------------------------------- results


def test_results_count_nodes_and_matches():
    gm = layer_graph()
    results = run_rewrites(gm, rewrites_named(["fuse_window_snapshot"]), GRAPH)
    # call_function nodes only: snapshot, append, two reads -> fused op, two reads.
    assert results == [RewriteResult("fuse_window_snapshot", True, 1, 4, 3)]
    assert results[0].to_json() == {"matches": 1, "nodes_before": 4, "nodes_after": 3}

    # A second run finds nothing left to fuse and says so.
    again = run_rewrites(gm, rewrites_named(["fuse_window_snapshot"]), GRAPH)
    assert again == [RewriteResult("fuse_window_snapshot", False, 0, 3, 3)]


class Noop(Rewrite):
    name = "noop"

    def rewrite(self, gm):
        return 0


class EraseOneRead(Rewrite):
    """Removes a node without counting a match: a change all the same."""

    name = "erase_one_read"

    def rewrite(self, gm):
        read = [n for n in gm.graph.nodes if n.target == ops.window_read.default][-1]
        read.replace_all_uses_with(read.args[0])
        gm.graph.erase_node(read)
        return 0


def test_results_of_rewrites_without_matches():
    results = run_rewrites(layer_graph(), [Noop(), FUSE_WINDOW_SNAPSHOT, EraseOneRead()], GRAPH)
    assert [(r.name, r.changed, r.matches, r.nodes_before, r.nodes_after) for r in results] == [
        ("noop", False, 0, 4, 4),
        ("fuse_window_snapshot", True, 1, 4, 3),
        ("erase_one_read", True, 0, 3, 2),
    ]


def test_a_rewrite_keeps_no_state_between_graphs():
    # The same instance on two graphs: each result is its own graph's.
    fused, untouched = layer_graph(), layer_graph()
    FUSE_WINDOW_SNAPSHOT(fused)
    assert FUSE_WINDOW_SNAPSHOT(fused) == RewriteResult("fuse_window_snapshot", False, 0, 3, 3)
    assert FUSE_WINDOW_SNAPSHOT(untouched) == RewriteResult("fuse_window_snapshot", True, 1, 4, 3)


def test_rewrites_named():
    assert rewrites_named(["fuse_window_snapshot"]) == [FUSE_WINDOW_SNAPSHOT]
    assert rewrites_named([]) == []


def test_rewrites_named_unknown_name():
    with pytest.raises(RewriteError) as info:
        rewrites_named(["fuse_window_snapshot", "nope"])
    message = str(info.value)
    assert "'nope'" in message
    assert "known rewrites" in message and "fuse_window_snapshot" in message


# ----------------------------------------------------------------------------- broken rewrites


def erase_read_still_returned(gm):
    """Erases a user of the staging placeholder that the output still returns."""
    read = find(gm, "call_function", ops.window_read.default)
    read.users.clear()  # erase_node refuses a node with users; force it
    gm.graph.erase_node(read)


def mutate_a_temporary(gm):
    """Appends into a clone of the staging buffer: a mutation no caller can see."""
    staging, kv = find(gm, "placeholder", "staging"), find(gm, "placeholder", "kv")
    with gm.graph.inserting_before(find(gm, "output")):
        tmp = gm.graph.call_function(torch.ops.aten.clone.default, (staging,))
        gm.graph.call_function(ops.cache_append.default, (tmp, kv, HISTORY, LAYOUT, PAGE, FMT))


def rename_placeholder(gm):
    find(gm, "placeholder", "kv").name = "kv_renamed"


def drop_an_output(gm):
    output = find(gm, "output")
    (outputs,) = output.args
    output.args = (outputs[:1],)


def add_op_outside_the_opset(gm):
    kv = find(gm, "placeholder", "kv")
    with gm.graph.inserting_before(find(gm, "output")):
        gm.graph.call_function(torch.ops.b12x_toolchain.not_in_opset.default, (kv,))


BROKEN = {
    # rewrite body: what the failure message must say about it
    "erase_read_still_returned": (erase_read_still_returned, "graph lint failed"),
    "mutate_a_temporary": (mutate_a_temporary, "mutates clone_default, which is not a graph input"),
    "rename_placeholder": (rename_placeholder, "calling convention changed"),
    "drop_an_output": (drop_an_output, "calling convention changed"),
    "add_op_outside_the_opset": (add_op_outside_the_opset, "not in op set v7"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_rewrite_is_named(case):
    body, problem = BROKEN[case]

    class BreakGraph(Rewrite):
        name = "break_graph"

        def rewrite(self, gm):
            body(gm)
            return 1

    with pytest.raises(RewriteError) as info:
        run_rewrites(layer_graph(), [FUSE_WINDOW_SNAPSHOT, BreakGraph()], GRAPH)
    message = str(info.value)
    assert "break_graph" in message
    assert f"{GRAPH} graph" in message
    assert problem in message
    assert "fuse_window_snapshot" not in message  # the rewrite before it did nothing wrong


def test_raising_rewrite_is_named():
    class Explode(Rewrite):
        name = "explode"

        def rewrite(self, gm):
            raise ValueError("boom")

    with pytest.raises(RewriteError) as info:
        run_rewrites(layer_graph(), [Explode()], GRAPH)
    message = str(info.value)
    assert "explode" in message and f"{GRAPH} graph" in message and "boom" in message
    assert isinstance(info.value.__cause__, ValueError)


# ----------------------------------------------------------------------------- invariants


def test_clean_graph_has_no_problems():
    gm = layer_graph()
    assert check_invariants(gm, signature(gm.graph)) == []
    FUSE_WINDOW_SNAPSHOT(gm)
    assert check_invariants(gm, signature(layer_graph().graph)) == []


def test_op_outside_the_opset_is_reported():
    class UsesUnknownOp(torch.nn.Module):
        def forward(self, kv):
            return torch.ops.b12x_toolchain.not_in_opset(kv)

    gm = torch.export.export(UsesUnknownOp(), (torch.zeros(ROWS, WIDTH, DIM),), strict=False).graph_module
    problems = check_invariants(gm, signature(gm.graph))
    assert problems == ["not_in_opset: b12x_toolchain.not_in_opset.default is not in op set v7"]
