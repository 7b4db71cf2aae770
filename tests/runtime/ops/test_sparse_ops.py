"""The op set's indexer and sparse attention: the dense definition, at the cost of what is live.

Each op is checked against the dense computation op set v1 did inside the graph — decode
every entry a row can hold, mask what a query may not see, take a stable top-k or a
masked softmax — and then for what the dense form cannot show: nothing past the committed
length is read (poisoned bytes there change nothing), and neither the capacity a block
table addresses nor which physical pages hold a row's entries changes any bit of any
output. The caches are paged: every row's entries in shuffled pages, 0xFF in pages no row
owns (`kernel_cases.page_case`). Last, `write_slots`, the writer of those pages.
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.ops.opset import ops
from b12x_toolchain.runtime.ops.sparse_ops import closing_ids
from benchmarks.kernel_cases import page_case, to_pages

H, DIM, INDEX_DIM = 4, 64, 32


def _case(rows, width, ratio, capacity, positions, seed=0, fmt="dsv41_nvfp4", index_fmt="dsv41_mxfp4", ties=False):
    g = torch.Generator().manual_seed(seed)
    committed = [p // ratio for p in positions]
    entries = torch.randn(rows, capacity, DIM, generator=g)
    index = torch.randn(rows, capacity, INDEX_DIM, generator=g)
    if ties:  # many exact zeros after the ReLU: every tie must go to the earlier entry
        index = index.abs().neg()
    case = {
        "q": torch.randn(rows, width, H, DIM, generator=g),
        "iq": torch.randn(rows, width, H, INDEX_DIM, generator=g).abs(),
        "head_weights": torch.rand(rows, width, H, generator=g),
        "entry_records": get_format(fmt).encode(entries),  # row r's entries, by id
        "index_records": get_format(index_fmt).encode(index),
        "new": get_format(fmt).decode(get_format(fmt).encode(torch.randn(rows, width, DIM, generator=g)), DIM),
        "new_keys": get_format(index_fmt).decode(get_format(index_fmt).encode(
            torch.randn(rows, width, INDEX_DIM, generator=g) * (0 if ties else 1)), INDEX_DIM),
        "positions": torch.tensor(positions, dtype=torch.int32),
        "window": torch.randn(rows, 6 + width, DIM, generator=g),
        "window_visible": torch.rand(rows, width, 6 + width, generator=g) > 0.3,
        "sinks": torch.randn(H, generator=g),
        "ratio": ratio, "fmt": fmt, "index_fmt": index_fmt, "committed": committed, "page_entries": 4,
    }
    return page_case(case, g)


def _dense_entries(records, new, fmt, dim):
    """Every entry a row can hold, then this pass's entries: op set v1's gather."""
    return torch.cat([get_format(fmt).decode(records, dim), new], dim=1)


def _dense_visible(c, capacity):
    """[R, T, capacity + T]: committed entries, and this pass's once their group closed."""
    R, T = c["q"].shape[:2]
    pos = c["positions"].long()[:, None] + torch.arange(T)
    stored = torch.arange(capacity)[None, :] < (pos[:, :1] // c["ratio"])
    closes = (pos + 1) % c["ratio"] == 0
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.cat([stored[:, None, :].expand(R, T, capacity), closes[:, None, :] & causal[None]], dim=2)


def _dense_ids(c, capacity):
    """Entry id of every dense column: slot index, then the id the pass row's group closes."""
    return torch.cat([torch.arange(capacity).expand(c["q"].shape[0], -1),
                      closing_ids(c["positions"], c["q"].shape[1], c["ratio"])], dim=1)


def _dense_scores(c, capacity):
    """[R, T, capacity + T] indexer scores of every dense column, -inf where not visible."""
    keys = _dense_entries(c["index_records"], c["new_keys"], c["index_fmt"], INDEX_DIM)
    per_head = torch.relu(torch.einsum("rthd,rsd->rths", c["iq"], keys)) * INDEX_DIM ** -0.5
    return (per_head * c["head_weights"][..., None]).sum(dim=2).masked_fill(~_dense_visible(c, capacity), -torch.inf)


def _dense_topk(c, capacity, k):
    score = _dense_scores(c, capacity)
    order = torch.sort(score, dim=-1, descending=True, stable=True)
    ids = _dense_ids(c, capacity)
    chosen = []
    for r in range(score.shape[0]):
        row = []
        for t in range(score.shape[1]):
            picked = order.indices[r, t, :k][order.values[r, t, :k] > -torch.inf]
            row.append(sorted(ids[r, picked].tolist()))
        chosen.append(row)
    return chosen


def _ids(out):
    return [[[i for i in t if i >= 0] for t in r] for r in out.tolist()]


def _blocks(c, cache=None):
    return ops.candidate_blocks(c["iq"], c["head_weights"], c["index_cache"] if cache is None else cache, c["new_keys"],
                                c["block_table"], c["positions"], c["ratio"], 4, 3, c["index_fmt"])


def _topk(c, k, candidates=None, cache=None):
    return ops.indexer_topk(c["iq"], c["head_weights"], c["index_cache"] if cache is None else cache, c["new_keys"],
                            c["block_table"], c["positions"], candidates, c["ratio"], 4, k, c["index_fmt"])


# (ratio, positions): nothing committed yet, groups closing inside the pass, long committed runs.
CASES = [(1, [0, 5, 30]), (2, [1, 10, 40]), (4, [3, 0, 64]), (128, [0, 130, 255])]


@pytest.mark.parametrize("ratio,positions", CASES)
@pytest.mark.parametrize("width", [8, 7])
def test_indexer_topk_is_the_dense_stable_top_k(ratio, positions, width):
    capacity = 512 // ratio if ratio < 128 else 4
    c = _case(3, width, ratio, capacity, positions)
    for k in (1, 5, 64):
        got = _topk(c, k)
        assert got.dtype == torch.int32 and got.shape == (3, width, k)
        assert _ids(got) == _dense_topk(c, capacity, k)
        # ascending ids, -1 padding only at the end
        for row in got.view(-1, k).tolist():
            live = [i for i in row if i >= 0]
            assert row == live + [-1] * (k - len(live)) and live == sorted(live)


def test_exact_ties_go_to_the_earlier_entry():
    c = _case(2, 8, 2, 256, [40, 41], ties=True)  # every score is zero
    got = _topk(c, 5)
    assert _ids(got) == _dense_topk(c, 256, 5)
    assert got[0, 0].tolist() == [0, 1, 2, 3, 4]


def test_candidates_restrict_the_choice_to_their_blocks():
    c = _case(1, 8, 1, 256, [60])
    blocks = torch.full((1, 8, 3), -1, dtype=torch.int32)
    blocks[..., 0], blocks[..., 1] = 2, 15  # entries 8..11 and this pass's 60..63 (block 15)
    got = _ids(_topk(c, 16, blocks))
    for t, ids in enumerate(got[0]):
        assert ids == [8, 9, 10, 11] + list(range(60, min(61 + t, 64)))


def test_candidate_blocks_are_the_best_blocks_plus_the_newest():
    c = _case(2, 8, 1, 256, [37, 5])
    got = _blocks(c)
    score = _dense_scores(c, 256)
    ids = _dense_ids(c, 256)
    for r in range(2):
        for t in range(8):
            best = {}
            for j, s in zip(ids[r].tolist(), score[r, t].tolist()):
                if s > -torch.inf:
                    best[j // 4] = max(best.get(j // 4, -torch.inf), s)
            top = sorted(sorted(best, key=lambda b: (-best[b], b))[:3])
            newest = (int(c["positions"][r]) + t + 1 - 1) // 4
            assert got[r, t].tolist() == top + [-1] * (3 - len(top)) + [newest]


def _dense_attention(c, capacity, indices):
    """Op set v1's attention: every entry slot, masked to the visible (and chosen) ones."""
    keys = torch.cat([c["window"], _dense_entries(c["entry_records"], c["new"], c["fmt"], DIM)], dim=1)
    visible = _dense_visible(c, capacity)
    if indices is not None:
        ids = _dense_ids(c, capacity)
        chosen = (ids[:, None, :, None] == indices.long()[:, :, None, :]).any(-1)
        visible = visible & chosen
    visible = torch.cat([c["window_visible"], visible], dim=2)
    keys = torch.where(visible.any(dim=1)[..., None], keys, torch.zeros_like(keys))
    scores = torch.einsum("rthd,rsd->rths", c["q"], keys) * DIM ** -0.5
    scores = scores.masked_fill(~visible[:, :, None, :], -torch.inf)
    sink = c["sinks"].view(1, 1, -1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
    return torch.einsum("rths,rsd->rthd", probs, keys)


def _attend(c, indices, cache=None, entries=True):
    return ops.sparse_attention(c["q"], c["window"], c["window_visible"], c["sinks"],
                                (c["entry_cache"] if cache is None else cache) if entries else None,
                                c["new"] if entries else None, c["block_table"], c["positions"], indices, c["ratio"],
                                c["fmt"])


@pytest.mark.parametrize("ratio,positions", CASES)
@pytest.mark.parametrize("chosen", [True, False])
def test_sparse_attention_is_the_masked_dense_softmax(ratio, positions, chosen):
    capacity = 512 // ratio if ratio < 128 else 4
    c = _case(3, 8, ratio, capacity, positions)
    indices = _topk(c, 5) if chosen else None
    got = _attend(c, indices)
    torch.testing.assert_close(got, _dense_attention(c, capacity, indices), rtol=1e-5, atol=1e-6)


def test_window_only_attention_ignores_entries():
    c = _case(2, 8, 2, 64, [3, 9])
    c["window_visible"][0, 0] = False  # a query that sees nothing: the sink takes all mass
    got = _attend(c, None, entries=False)
    assert torch.equal(got[0, 0], torch.zeros(H, DIM))
    dense = _dense_attention(c, 64, torch.full((2, 8, 1), -1))  # no entry chosen: the window alone
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-6)


def _outputs(c, **caches):
    """Every op's result on case c (caches: entry_cache / index_cache replaced)."""
    c = dict(c, **caches)
    indices = _topk(c, 5)
    return [indices, _blocks(c), _topk(c, 5, _blocks(c)), _attend(c, indices), _attend(c, None)]


@pytest.mark.parametrize("ratio,positions", CASES)
def test_nothing_past_the_committed_length_is_read_and_capacity_changes_no_bit(ratio, positions):
    capacity = 512 // ratio if ratio < 128 else 4
    c = _case(3, 8, ratio, capacity, positions)
    want = _outputs(c)
    # The same pages, every record past each row's committed length NaN (0xFF).
    poisoned = {}
    for name in ("entry", "index"):
        records = c[f"{name}_records"].clone()
        for r, committed in enumerate(c["committed"]):
            records[r, committed:] = 0xFF
        poisoned[f"{name}_cache"] = to_pages(records, c["block_table"], 4, c[f"{name}_cache"].shape[0])
    # Block tables addressing twice the capacity, in a larger pool.
    bigger = page_case(c, torch.Generator().manual_seed(1), width=2 * c["block_table"].shape[1], spare=9)
    for got in (_outputs(c, **poisoned), _outputs(bigger)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("ratio,positions", CASES)
def test_results_do_not_depend_on_which_pages_hold_the_entries(ratio, positions):
    capacity = 512 // ratio if ratio < 128 else 4
    c = _case(3, 8, ratio, capacity, positions)
    other = page_case(c, torch.Generator().manual_seed(5))
    mapped = c["block_table"] >= 0
    assert torch.equal(other["block_table"] >= 0, mapped)  # the same pages per row...
    assert not torch.equal(other["block_table"][mapped], c["block_table"][mapped])  # ...elsewhere
    assert all(torch.equal(a, b) for a, b in zip(_outputs(other), _outputs(c)))


def test_fake_implementations_give_static_shapes():
    c = _case(3, 8, 2, 64, [1, 2, 3])
    with torch._subclasses.FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in c.items()}
        assert _topk(fake, 7).shape == (3, 8, 7)
        assert _blocks(fake).shape == (3, 8, 4)
        assert _attend(fake, None).shape == (3, 8, H, DIM)


# ---------------------------------------------------------------- write_slots


@pytest.mark.parametrize("fmt", ["dsv41_mxfp8", "dsv41_nvfp4", "bf16", "bytes"])
def test_write_slots_writes_exactly_the_mapped_records(fmt):
    g = torch.Generator().manual_seed(7)
    rows, width, dim, per_page, pages = 3, 8, 64, 4, 9
    record_bytes = get_format("dsv41_mxfp8" if fmt == "bytes" else fmt).row_bytes(dim)
    if fmt == "bytes":  # already-encoded records, copied as they are
        values = torch.randint(0, 256, (rows, width, record_bytes), dtype=torch.uint8, generator=g)
        records = values
    else:
        values = torch.randn(rows, width, dim, generator=g)
        records = get_format(fmt).encode(values)
    cache = torch.full((pages, per_page * record_bytes), 0xFF, dtype=torch.uint8)
    slots = torch.randperm(pages * per_page, generator=g)[: rows * width].view(rows, width)
    slots[0, 2] = slots[1, :3] = slots[2, 7] = -1  # tokens that write nothing
    want = cache.clone()
    for (r, t), s in zip(torch.cartesian_prod(torch.arange(rows), torch.arange(width)).tolist(), slots.flatten().tolist()):
        if s >= 0:  # record s % per_page of page s // per_page
            at = (s % per_page) * record_bytes
            want[s // per_page, at : at + record_bytes] = records[r, t]
    assert not torch.equal(want, cache)
    ops.write_slots(cache, values, slots.to(torch.int32), fmt)
    assert torch.equal(cache, want)  # the mapped records, and every other byte still 0xFF
