"""Dependency graph: data edges plus memory-effect edges on the buffers ops mutate.

The custom ops return nothing, so only these memory edges order them; a rewrite that
moves an op trusts this graph. Each test lists the exact edges it expects.
"""

from __future__ import annotations

import pytest
import torch

import b12x_toolchain.runtime.ops.opset  # noqa: F401  (registers the b12x op set)
from b12x_toolchain.runtime.rewrite.dependency import dependency_graph, order, tensor_args
from passes.layer_graphs import (
    DIM,
    FMT,
    HISTORY,
    LAYOUT,
    PAGE,
    ROW_BYTES,
    ROWS,
    TOKENS,
    WIDTH,
    export,
    layer_inputs,
    ops,
)


def memory_edges(dag) -> set:
    """(from, to, kind, buffer) by node name for every edge that is not a data edge."""
    return {(u.name, v.name, d["kind"], d["buffer"]) for u, v, d in dag.edges(data=True) if d["kind"] != "data"}


def node(gm: torch.fx.GraphModule, target) -> torch.fx.Node:
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]
    assert len(found) == 1, f"expected one {target} node, found {len(found)}"
    return found[0]


def snapshot(ring, staging, row_ids, positions):
    ops.window_snapshot(ring, staging, row_ids, positions, HISTORY, LAYOUT, PAGE)


def append(staging, kv):
    ops.cache_append(staging, kv, HISTORY, LAYOUT, PAGE, FMT)


# ----------------------------------------------------------------------------- schema reading


def test_tensor_args_marks_only_schema_mutated_arguments():
    class Pair(torch.nn.Module):
        def forward(self, ring, staging, kv, row_ids, positions):
            snapshot(ring, staging, row_ids, positions)
            append(staging, kv)

    gm = export(Pair(), *layer_inputs())
    snap = node(gm, ops.window_snapshot.default)
    assert [(a.name, w) for a, w in tensor_args(snap)] == [
        ("ring", False), ("staging", True), ("row_ids", False), ("positions", False)]
    app = node(gm, ops.cache_append.default)
    assert [(a.name, w) for a, w in tensor_args(app)] == [("staging", True), ("kv", False)]


# ----------------------------------------------------------------------------- memory edges


class SnapshotAppendRead(torch.nn.Module):
    def forward(self, ring, staging, kv, row_ids, positions):
        snapshot(ring, staging, row_ids, positions)
        append(staging, kv)
        return ops.window_read(staging, TOKENS, DIM, FMT)


def test_append_depends_on_snapshot_through_the_staging_buffer():
    gm = export(SnapshotAppendRead(), *layer_inputs())
    dag = dependency_graph(gm.graph)
    # No user links the two ops: only the after-write edge on the staging buffer orders
    # them. The snapshot only reads the ring, row_ids and positions: no edges for those.
    assert memory_edges(dag) == {
        ("window_snapshot", "cache_append", "after-write", "staging"),
        ("cache_append", "window_read", "after-write", "staging"),
    }
    # Data edges run from each argument to its consumer.
    snap = node(gm, ops.window_snapshot.default)
    assert {p.name for p in dag.predecessors(snap)} == {"ring", "staging", "row_ids", "positions"}
    assert all(dag.edges[p, snap]["kind"] == "data" for p in dag.predecessors(snap))
    # Nodes carry their program order.
    assert [order(dag, n) for n in gm.graph.nodes] == list(range(len(gm.graph.nodes)))


def test_reader_between_snapshot_and_append():
    class ReadBetween(torch.nn.Module):
        def forward(self, ring, staging, kv, row_ids, positions):
            snapshot(ring, staging, row_ids, positions)
            history = ops.window_read(staging, HISTORY, DIM, FMT)
            append(staging, kv)
            return history, ops.window_read(staging, TOKENS, DIM, FMT)

    gm = export(ReadBetween(), *layer_inputs())
    assert memory_edges(dependency_graph(gm.graph)) == {
        ("window_snapshot", "window_read", "after-write", "staging"),  # reads what it wrote
        ("window_read", "cache_append", "write-after-read", "staging"),  # must read first
        ("window_snapshot", "cache_append", "after-write", "staging"),
        ("cache_append", "window_read_1", "after-write", "staging"),
    }


def test_ring_writer_after_snapshot():
    class CommitBetween(torch.nn.Module):
        def forward(self, ring, staging, kv, row_ids, positions, other_staging, accept_len):
            snapshot(ring, staging, row_ids, positions)
            ops.window_commit(ring, other_staging, row_ids, positions, accept_len, HISTORY, WIDTH)
            append(staging, kv)
            return ops.window_read(staging, TOKENS, DIM, FMT)

    ring, staging, kv, row_ids, positions = layer_inputs()
    gm = export(CommitBetween(), ring, staging, kv, row_ids, positions, staging.clone(), row_ids.clone())
    # The commit overwrites ring rows the snapshot read: it must stay after the snapshot.
    assert memory_edges(dependency_graph(gm.graph)) == {
        ("window_snapshot", "window_commit", "write-after-read", "ring"),
        ("window_snapshot", "cache_append", "after-write", "staging"),
        ("cache_append", "window_read", "after-write", "staging"),
    }


# ----------------------------------------------------------------------------- views


VIEWS = {
    "select": lambda s: s[0],
    "view": lambda s: s.view(ROWS, -1, ROW_BYTES),
    "slice_then_view": lambda s: s[0:1].view(1, -1, ROW_BYTES),
    "split_then_getitem": lambda s: s.split(1)[0],
}


@pytest.mark.parametrize("case", list(VIEWS))
def test_view_of_staging_is_tracked_to_its_placeholder(case):
    make_view = VIEWS[case]

    class ReadThroughView(torch.nn.Module):
        # The view exists before the append, and the read of it comes after the append:
        # only the view's root (the staging placeholder) links the read to the append.
        def forward(self, ring, staging, kv, row_ids, positions):
            snapshot(ring, staging, row_ids, positions)
            view = make_view(staging)
            append(staging, kv)
            return ops.window_read(view, TOKENS, DIM, FMT)

    gm = export(ReadThroughView(), *layer_inputs())
    dag = dependency_graph(gm.graph)
    app, read = node(gm, ops.cache_append.default), node(gm, ops.window_read.default)
    assert dag.has_edge(app, read), "the read of the view does not depend on the append"
    assert dag.edges[app, read] == {"kind": "after-write", "buffer": "staging"}


def test_read_of_a_view_made_before_the_snapshot():
    class EarlyView(torch.nn.Module):
        def forward(self, ring, staging, kv, row_ids, positions):
            view = staging.view(ROWS, -1, ROW_BYTES)
            snapshot(ring, staging, row_ids, positions)
            history = ops.window_read(view, HISTORY, DIM, FMT)
            append(staging, kv)
            return history

    gm = export(EarlyView(), *layer_inputs())
    assert memory_edges(dependency_graph(gm.graph)) == {
        ("view", "window_snapshot", "write-after-read", "staging"),  # the view op takes staging
        ("window_snapshot", "window_read", "after-write", "staging"),
        ("window_read", "cache_append", "write-after-read", "staging"),
        ("window_snapshot", "cache_append", "after-write", "staging"),
    }


def test_reader_taking_the_buffer_in_a_list_argument():
    class CatBetween(torch.nn.Module):
        def forward(self, ring, staging, kv, row_ids, positions):
            snapshot(ring, staging, row_ids, positions)
            both = torch.cat([staging, staging])  # aten.cat takes a list of tensors
            append(staging, kv)
            return both

    gm = export(CatBetween(), *layer_inputs())
    dag = dependency_graph(gm.graph)
    snap, app = node(gm, ops.window_snapshot.default), node(gm, ops.cache_append.default)
    cat = node(gm, torch.ops.aten.cat.default)
    assert dag.has_edge(snap, cat), "cat reads what the snapshot wrote"
    assert dag.has_edge(cat, app), "the append overwrites what cat read"
