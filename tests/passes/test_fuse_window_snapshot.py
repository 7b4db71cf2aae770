"""fuse_window_snapshot: window_snapshot + cache_append on one staging buffer -> one fused op.

Each test builds the graph before the pass and, where the pass should fire, the graph
expected after it (a module written directly with the fused op), then compares their
structure. The numeric tests run the rewritten graph against the unrewritten one.
"""

from __future__ import annotations

import pytest
import torch

import b12x_toolchain.runtime.ops.opset  # noqa: F401  (registers the b12x op set)
from b12x_toolchain.passes.fuse_window_snapshot import FUSE_WINDOW_SNAPSHOT as fuse
from b12x_toolchain.runtime.ops.qualify import UnsupportedConfiguration

from .layer_graphs import (
    DIM,
    FMT,
    HISTORY,
    LAYOUT,
    PAGE,
    ROW_BYTES,
    ROWS,
    SLOTS,
    TOKENS,
    WIDTH,
    export,
    kv,
    layer_inputs,
    ops,
    ring,
    row_input,
    staging,
    structure,
)


def call_targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def node_list(gm: torch.fx.GraphModule) -> list:
    """Names, targets and arguments: what "the graph is unchanged" compares."""
    return [(n.name, n.op, str(n.target), str(n.args)) for n in gm.graph.nodes]


def random_layer(gen: torch.Generator, history=HISTORY) -> dict:
    return {
        "ring": torch.randint(0, 256, (SLOTS, history, ROW_BYTES), dtype=torch.uint8, generator=gen),
        "kv": torch.randn(ROWS, WIDTH, DIM, generator=gen) * 4,
        "row_ids": torch.randint(0, SLOTS, (ROWS,), dtype=torch.int32, generator=gen),
        # Past the ring capacity, so the snapshot wraps around the ring.
        "positions": torch.randint(HISTORY, 5 * HISTORY, (ROWS,), dtype=torch.int32, generator=gen),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    # Random ring bytes decode to NaN in places and NaN != NaN, so compare bit patterns.
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def run_poisoned(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> tuple[list, list]:
    """Run on copies of the inputs with every staging buffer (uint8 5-d) filled with 0xFF.

    Returns (the inputs after the run, the outputs): any byte the graph leaves unwritten
    shows up as 0xFF, so both graphs must write exactly the same bytes.
    """
    args = [t.clone() for t in inputs]
    for t in args:
        if t.dtype == torch.uint8 and t.dim() == 5:
            t.fill_(0xFF)
    outputs = gm(*args)
    return args, list(outputs)


def assert_same_results(unfused: torch.fx.GraphModule, fused: torch.fx.GraphModule, inputs: list) -> None:
    args_a, out_a = run_poisoned(unfused, inputs)
    args_b, out_b = run_poisoned(fused, inputs)
    # Plain booleans keep a failure report short (the tensors are thousands of bytes).
    inputs_equal = [torch.equal(a, b) for a, b in zip(args_a, args_b)]
    assert all(inputs_equal), f"inputs differ after the run: {inputs_equal}"
    assert len(out_a) == len(out_b)
    outputs_equal = [torch.equal(bits(a), bits(b)) for a, b in zip(out_a, out_b)]
    assert all(outputs_equal), f"outputs differ: {outputs_equal}"


# ----------------------------------------------------------------------------- modules


class SnapshotAppendRead(torch.nn.Module):
    """Before: the pair the exporter emits for one staged window layer."""

    def forward(self, ring, staging, kv, row_ids, positions):
        ops.window_snapshot(ring, staging, row_ids, positions, HISTORY, LAYOUT, PAGE)
        ops.cache_append(staging, kv, HISTORY, LAYOUT, PAGE, FMT)
        return ops.window_read(staging, TOKENS, DIM, FMT)


class FusedRead(torch.nn.Module):
    """Expected after: the same layer written with the fused op."""

    def forward(self, ring, staging, kv, row_ids, positions):
        ops.window_snapshot_append(ring, staging, kv, row_ids, positions, HISTORY, LAYOUT, PAGE, FMT)
        return ops.window_read(staging, TOKENS, DIM, FMT)


# Program orders of the two layers' ops: "sA" is layer A's snapshot, "aB" layer B's append.
ORDERS = {
    "in_order": ("sA", "aA", "sB", "aB"),
    "nested": ("sA", "sB", "aB", "aA"),
    # Crossed: the snapshot nearest before append A belongs to layer B, so a pass that
    # paired by program order alone would fuse across layers here.
    "crossed": ("sA", "sB", "aA", "aB"),
}


class TwoLayers(torch.nn.Module):
    """Two layers sharing row_ids/positions, their ops in the given program order."""

    def __init__(self, steps: tuple):
        super().__init__()
        self.steps = steps

    def forward(self, ring_a, staging_a, kv_a, ring_b, staging_b, kv_b, row_ids, positions):
        layers = {"A": (ring_a, staging_a, kv_a), "B": (ring_b, staging_b, kv_b)}
        for step in self.steps:
            ring, staging, kv = layers[step[1]]
            if step[0] == "s":
                ops.window_snapshot(ring, staging, row_ids, positions, HISTORY, LAYOUT, PAGE)
            else:
                ops.cache_append(staging, kv, HISTORY, LAYOUT, PAGE, FMT)
        return ops.window_read(staging_a, TOKENS, DIM, FMT), ops.window_read(staging_b, TOKENS, DIM, FMT)


class TwoLayersFused(torch.nn.Module):
    """Expected after TwoLayers: each layer's fused op sits where its append was."""

    def __init__(self, steps: tuple):
        super().__init__()
        self.layers = [step[1] for step in steps if step[0] == "a"]

    def forward(self, ring_a, staging_a, kv_a, ring_b, staging_b, kv_b, row_ids, positions):
        layers = {"A": (ring_a, staging_a, kv_a), "B": (ring_b, staging_b, kv_b)}
        for layer in self.layers:
            ring, staging, kv = layers[layer]
            ops.window_snapshot_append(ring, staging, kv, row_ids, positions, HISTORY, LAYOUT, PAGE, FMT)
        return ops.window_read(staging_a, TOKENS, DIM, FMT), ops.window_read(staging_b, TOKENS, DIM, FMT)


def two_layer_inputs() -> tuple:
    return ring(), staging(), kv(), ring(), staging(), kv(), row_input(), row_input()


def random_two_layer_inputs(gen: torch.Generator) -> list:
    a, b = random_layer(gen), random_layer(gen)
    return [a["ring"], staging(), a["kv"], b["ring"], staging(), b["kv"], a["row_ids"], a["positions"]]


# ----------------------------------------------------------------------------- the rewrite


def test_pair_becomes_the_fused_op():
    gm = export(SnapshotAppendRead(), *layer_inputs())
    expected = export(FusedRead(), *layer_inputs())
    nodes_before = len(gm.graph.nodes)
    assert call_targets(gm) == [ops.window_snapshot.default, ops.cache_append.default, ops.window_read.default]

    result = fuse(gm)
    assert (result.changed, result.matches) == (True, 1)
    assert (result.nodes_before, result.nodes_after) == (3, 2)
    assert len(gm.graph.nodes) == nodes_before - 1
    assert call_targets(gm) == call_targets(expected)
    # Same arguments too: the fused op takes ring/row_ids/positions from the snapshot
    # and kv/fmt from the append.
    assert structure(gm) == structure(expected)
    gm.graph.lint()


def test_fused_graph_writes_the_same_bytes():
    unfused = export(SnapshotAppendRead(), *layer_inputs())
    fused = export(SnapshotAppendRead(), *layer_inputs())
    assert fuse(fused).changed
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        layer = random_layer(gen)
        inputs = [layer["ring"], staging(), layer["kv"], layer["row_ids"], layer["positions"]]
        assert_same_results(unfused, fused, inputs)
        # Guard against comparing two no-ops: the snapshot and the append both wrote.
        written, _ = run_poisoned(fused, inputs)
        tokens = written[1].view(ROWS, -1, ROW_BYTES)
        assert not (tokens[:, :TOKENS] == 0xFF).all(dim=-1).any()
        assert (tokens[:, TOKENS:] == 0xFF).all()  # pages past the window stay untouched


@pytest.mark.parametrize("case", list(ORDERS))
def test_two_layers_matched_by_staging_buffer(case):
    steps = ORDERS[case]
    gm = export(TwoLayers(steps), *two_layer_inputs())
    unfused = export(TwoLayers(steps), *two_layer_inputs())
    expected = export(TwoLayersFused(steps), *two_layer_inputs())

    result = fuse(gm)
    assert (result.changed, result.matches) == (True, 2)
    # The fused ops' staging, ring and kv arguments show which snapshot went with which
    # append: the structure matches only if every pair shares its staging buffer.
    assert structure(gm) == structure(expected)
    assert_same_results(unfused, gm, random_two_layer_inputs(torch.Generator().manual_seed(1)))


# ----------------------------------------------------------------------------- refusals


class ReadBetween(torch.nn.Module):
    """A reader of the staging buffer between the pair sees only the snapshot."""

    def forward(self, ring, staging, kv, row_ids, positions):
        ops.window_snapshot(ring, staging, row_ids, positions, HISTORY, LAYOUT, PAGE)
        history = ops.window_read(staging, HISTORY, DIM, FMT)
        ops.cache_append(staging, kv, HISTORY, LAYOUT, PAGE, FMT)
        return history, ops.window_read(staging, TOKENS, DIM, FMT)


class CommitBetween(torch.nn.Module):
    """A commit (from another staging buffer) writes the ring the snapshot read."""

    def forward(self, ring, staging, kv, row_ids, positions, other_staging, accept_len):
        ops.window_snapshot(ring, staging, row_ids, positions, HISTORY, LAYOUT, PAGE)
        ops.window_commit(ring, other_staging, row_ids, positions, accept_len, HISTORY, WIDTH)
        ops.cache_append(staging, kv, HISTORY, LAYOUT, PAGE, FMT)
        return ops.window_read(staging, TOKENS, DIM, FMT)


class WriteRowsBetween(torch.nn.Module):
    """write_rows into the ring the snapshot read."""

    def forward(self, ring, staging, kv, row_ids, positions, index, valid):
        ops.window_snapshot(ring, staging, row_ids, positions, HISTORY, LAYOUT, PAGE)
        ops.write_rows(ring, kv, row_ids, index, valid, FMT)
        ops.cache_append(staging, kv, HISTORY, LAYOUT, PAGE, FMT)
        return ops.window_read(staging, TOKENS, DIM, FMT)


class DifferentHistory(torch.nn.Module):
    def forward(self, ring, staging, kv, row_ids, positions):
        ops.window_snapshot(ring, staging, row_ids, positions, HISTORY, LAYOUT, PAGE)
        ops.cache_append(staging, kv, HISTORY - WIDTH, LAYOUT, PAGE, FMT)
        return ops.window_read(staging, TOKENS, DIM, FMT)


class DifferentPageSize(torch.nn.Module):
    def forward(self, ring, staging, kv, row_ids, positions):
        ops.window_snapshot(ring, staging, row_ids, positions, HISTORY, LAYOUT, PAGE)
        ops.cache_append(staging, kv, HISTORY, LAYOUT, 2 * PAGE, FMT)
        return ops.window_read(staging, TOKENS, DIM, FMT)


class DifferentStaging(torch.nn.Module):
    def forward(self, ring, staging, kv, row_ids, positions, other_staging):
        ops.window_snapshot(ring, staging, row_ids, positions, HISTORY, LAYOUT, PAGE)
        ops.cache_append(other_staging, kv, HISTORY, LAYOUT, PAGE, FMT)
        return ops.window_read(staging, TOKENS, DIM, FMT), ops.window_read(other_staging, TOKENS, DIM, FMT)


class CatBetween(torch.nn.Module):
    """A reader that takes the staging buffer inside a list argument (aten.cat)."""

    def forward(self, ring, staging, kv, row_ids, positions):
        ops.window_snapshot(ring, staging, row_ids, positions, HISTORY, LAYOUT, PAGE)
        both = torch.cat([staging, staging])
        ops.cache_append(staging, kv, HISTORY, LAYOUT, PAGE, FMT)
        return both


def _index_and_valid():
    return torch.zeros(ROWS, WIDTH, dtype=torch.int64), torch.ones(ROWS, WIDTH, dtype=torch.bool)


ILLEGAL = {
    "read_between": (ReadBetween, lambda: layer_inputs()),
    "commit_writes_ring_between": (CommitBetween, lambda: (*layer_inputs(), staging(), row_input())),
    "write_rows_writes_ring_between": (WriteRowsBetween, lambda: (*layer_inputs(), *_index_and_valid())),
    "different_history": (DifferentHistory, lambda: layer_inputs()),
    "different_page_size": (DifferentPageSize, lambda: layer_inputs()),
    "different_staging": (DifferentStaging, lambda: (*layer_inputs(), staging())),
    "cat_reads_staging_between": (CatBetween, lambda: layer_inputs()),
}


@pytest.mark.parametrize("case", list(ILLEGAL))
def test_not_fused_when_illegal(case):
    module, inputs = ILLEGAL[case]
    gm = export(module(), *inputs())
    # Each module does contain a snapshot and an append, so a refusal is the pass's choice.
    assert ops.window_snapshot.default in call_targets(gm)
    assert ops.cache_append.default in call_targets(gm)
    before = node_list(gm)

    result = fuse(gm)
    assert (result.changed, result.matches) == (False, 0)
    assert node_list(gm) == before


def test_reader_in_a_list_argument_still_sees_only_the_snapshot():
    # What goes wrong if the cat case above is fused: the snapshot moves past the cat,
    # so the cat reads the staging buffer before the snapshot wrote it.
    unfused = export(CatBetween(), *layer_inputs())
    rewritten = export(CatBetween(), *layer_inputs())
    fuse(rewritten)
    layer = random_layer(torch.Generator().manual_seed(2))
    inputs = [layer["ring"], staging(), layer["kv"], layer["row_ids"], layer["positions"]]
    assert_same_results(unfused, rewritten, inputs)


# ----------------------------------------------------------------------------- qualification


class QualifiedThenUnqualified(torch.nn.Module):
    """Layer A is qualified, layer B is not; A comes first so a half rewrite would show."""

    def __init__(self, history_b: int, layout_b: str, page_b: int):
        super().__init__()
        self.history_b, self.layout_b, self.page_b = history_b, layout_b, page_b

    def forward(self, ring_a, staging_a, kv_a, ring_b, staging_b, kv_b, row_ids, positions):
        h, lay, p = self.history_b, self.layout_b, self.page_b
        ops.window_snapshot(ring_a, staging_a, row_ids, positions, HISTORY, LAYOUT, PAGE)
        ops.cache_append(staging_a, kv_a, HISTORY, LAYOUT, PAGE, FMT)
        ops.window_snapshot(ring_b, staging_b, row_ids, positions, h, lay, p)
        ops.cache_append(staging_b, kv_b, h, lay, p, FMT)
        return ops.window_read(staging_a, TOKENS, DIM, FMT), ops.window_read(staging_b, h + WIDTH, DIM, FMT)


UNQUALIFIED = {
    # case: (history, layout, page size of layer B, what the message must name)
    "history_64": (64, "NHD", PAGE, ["history length 64", "[128]"]),
    "layout_HND": (HISTORY, "HND", PAGE, ["'HND'", "['NHD']"]),
    "page_size_8": (HISTORY, "NHD", 8, ["page size 8", "[16, 32, 64, 128]"]),
}


@pytest.mark.parametrize("case", list(UNQUALIFIED))
def test_unqualified_match_refused_without_half_rewrite(case):
    history, layout, page, fragments = UNQUALIFIED[case]
    inputs = (ring(), staging(), kv(), ring(history), staging(history, layout, page), kv(), row_input(), row_input())
    gm = export(QualifiedThenUnqualified(history, layout, page), *inputs)
    before = node_list(gm)

    with pytest.raises(UnsupportedConfiguration) as info:
        fuse(gm)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message
    # The message says which pass and which buffer, so an export failure is actionable.
    assert "fuse_window_snapshot" in message and "staging_b" in message
    # Layer A was fusable, but nothing may be rewritten once any match is refused.
    assert node_list(gm) == before


def test_unqualified_history_alone():
    # The plain case: a single layer with history 64.
    inputs = (ring(64), staging(64), kv(), row_input(), row_input())

    class Layer64(torch.nn.Module):
        def forward(self, ring, staging, kv, row_ids, positions):
            ops.window_snapshot(ring, staging, row_ids, positions, 64, LAYOUT, PAGE)
            ops.cache_append(staging, kv, 64, LAYOUT, PAGE, FMT)
            return ops.window_read(staging, 64 + WIDTH, DIM, FMT)

    gm = export(Layer64(), *inputs)
    before = node_list(gm)
    with pytest.raises(UnsupportedConfiguration, match=r"history length 64 .*\[128\]"):
        fuse(gm)
    assert node_list(gm) == before
