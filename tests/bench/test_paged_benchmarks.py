"""The paged_memory and prefix_hit_ttft benchmarks at a reduced size: their rows are well formed.

The real benchmarks run dsv41-tiny exported at max_seq_len 1M and 256k (context_scaling's
variants); here the byte accounting runs on recipes' cache specs (no export) and the
serving and prefix-hit paths on the suite's small package (the tiny recipe cut to a
window-only and a ratio-2 layer, max_seq_len 1k, loaded once per run and shared), with a
few short requests and prefixes.
Nothing here asserts a speed.
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.exporter.model.pass_modules import PASSES  # noqa: E402
from b12x_toolchain.exporter.recipe.dims import Dims  # noqa: E402
from benchmarks import paged_memory as pm  # noqa: E402
from benchmarks import prefix_hit_ttft as ph  # noqa: E402
from benchmarks import registry  # noqa: E402
from benchmarks.registry import REGISTRY, Settings  # noqa: E402
from benchmarks.run import table  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ONE_ROUND = Settings(repeat=1, warmup=0)


def specs_of(recipe):
    return PASSES["prefill"](Dims.from_recipe(recipe)).caches()


def check_counts(m, unit: str) -> None:
    assert m.unit == unit and m.baseline > 0 and m.candidate >= 0
    assert m.ratio == pytest.approx(m.candidate / m.baseline, rel=1e-12)
    assert m.baseline_samples == m.candidate_samples == []
    assert m.to_json()["params"] == m.params  # JSON-ready, as the runner writes it


def test_registered():
    assert REGISTRY["paged_memory"] is pm.paged_memory_benchmark
    assert REGISTRY["prefix_hit_ttft"] is ph.prefix_hit_ttft_benchmark
    assert all(p % 64 == 0 for p in ph.PREFIXES)  # the tiny recipe's prefill chunk
    assert max(ph.PREFIXES) + ph.TAIL < ph.MAX_SEQ_LEN and set(ph.COLD_ROUNDS) == set(ph.PREFIXES)


def test_byte_accounting_of_the_tiny_recipe(tiny_recipe):
    """The tiny recipe's figures, worked out by hand from its recipe (README of the benchmark)."""
    pools, rings = pm.pool_bytes(specs_of(tiny_recipe)), pm.ring_bytes(specs_of(tiny_recipe))
    entries, index = pools["entry_pages"], pools["index_key_pages"]
    # Full layers 2 (ratio 2) and 4 (ratio 1): nvfp4 entries of 36 bytes, 64 tokens per page.
    assert (entries.caches, entries.tokens_per_page, entries.pages_per_slot) == (2, 64, 16)
    assert entries.page_bytes == 32 * 36 + 64 * 36 and entries.bytes_per_token == 36 / 2 + 36
    # mxfp4 index keys of 17 bytes, 32 tokens per page.
    assert (index.caches, index.tokens_per_page, index.page_bytes) == (2, 32, 16 * 17 + 32 * 17)
    assert index.bytes_per_token == index.record_bytes_per_token == 17 / 2 + 17
    assert {k: (r.caches, r.slot_bytes) for k, r in rings.items()} == {
        "window_ring": (6, 6 * 128 * 66), "compressor_state": (1, 2 * 512), "draft_window": (2, 2 * 128 * 66),
        "token_history": (1, 4 * 4), "seq_len": (1, 4)}  # Engram: the last 4 compressed ids, float32
    ring = sum(r.slot_bytes for r in rings.values())
    assert pm.slot_bytes(pools, rings, None) == ring + 16 * entries.page_bytes + 32 * index.page_bytes
    assert pm.slot_bytes(pools, rings, 100) == ring + 2 * entries.page_bytes + 4 * index.page_bytes
    assert pm.slot_bytes(pools, rings, 1024) == pm.slot_bytes(pools, rings, None)  # max_seq_len: the same
    text = pm.byte_table(pools, rings, "tiny")
    assert text.splitlines()[0] == "tiny" and "entry_pages" in text and "79.5" in text and str(ring) in text


def test_full_size_cases(tiny_recipe):
    specs = specs_of(tiny_recipe)
    rows = pm.full_size_cases(specs, "tiny", tokens=(256, 1024, 4096))  # 4096 is past max_seq_len: left out
    assert [(m.benchmark, m.case) for m in rows] == [
        ("paged_memory.full_size_per_token", "tiny entry_pages"),
        ("paged_memory.full_size_per_token", "tiny index_key_pages"),
        ("paged_memory.full_size_rings", "tiny window_ring"),
        ("paged_memory.full_size_rings", "tiny compressor_state"),
        ("paged_memory.full_size_rings", "tiny token_history"),
        ("paged_memory.full_size_rings", "tiny draft_window"),
        ("paged_memory.full_size_rings", "tiny seq_len"),
        ("paged_memory.full_size_slot", "tiny slot, 256 tokens"),
        ("paged_memory.full_size_slot", "tiny slot, 1k tokens"),
    ]
    per_token, rings, slots = rows[:2], rows[2:7], rows[7:]
    for m in per_token:
        check_counts(m, "bytes/token")
        assert m.ratio == 1  # a page is whole records: no padding
    for m in rings:
        check_counts(m, "bytes/slot")
    assert sum(m.candidate for m in rings) == rings[0].baseline
    for m in slots:
        check_counts(m, "bytes")
    assert slots[0].ratio < 1 and slots[1].ratio == 1  # a full slot is the contiguous one


def test_full_size_specs_are_the_dsv41_recipe():
    pools = pm.pool_bytes(pm.full_size_specs())
    assert {name: p.bytes_per_token for name, p in pools.items()} == {"entry_pages": 720, "index_key_pages": 170}


def test_pages_wanted_and_request_set():
    requests = pm.request_set(512, count=5, lengths=(20, 200), new_tokens=3)
    assert len(requests) == 5 and all(20 <= len(r.prompt) <= 200 and r.max_new_tokens == 3 for r in requests)
    assert pm.request_set(512, count=5, lengths=(20, 200), new_tokens=3) == requests  # seeded
    pool = pm.PoolBytes("p", 1, 64, 16, 100, 1.0, 1.0)
    short = [pm.Request([0] * 53, 3)]  # span 53 + 3 + 8 = 64: one page
    assert pm.pages_wanted({"p": pool}, short, 8, 1024) == {"p": 1}
    assert pm.pages_wanted({"p": pool}, short + [pm.Request([0] * 54, 3)], 8, 1024) == {"p": 3}
    assert pm.pages_wanted({"p": pool}, [pm.Request([0] * 1020, 3)], 8, 1024) == {"p": 16}  # capped


def test_serving_rows_on_the_small_package(small_pkg):
    package = small_pkg
    requests = pm.request_set(package.vocab_size, count=6, lengths=(20, 80), new_tokens=2)
    result = pm.serve(package, requests, slots=4)
    # The pools hold every request's pages at once: the last two wait for a slot, never for pages.
    assert result["page_waits"] == 0 and result["requests"] == 6 and result["slots"] == 4
    rows = pm.serving_cases(result)
    assert [m.case for m in rows] == ["allocated vs contiguous", "peak in use vs contiguous",
                                      "peak in use vs allocated", "peak in use vs tokens held"]
    for m in rows:
        check_counts(m, "bytes")
        assert m.benchmark == "paged_memory.serving"
    allocated, vs_contiguous, vs_allocated, vs_tokens = rows
    assert 0 < vs_contiguous.ratio <= allocated.ratio < 1 and 0 < vs_allocated.ratio <= 1
    assert vs_tokens.ratio >= 1  # whole pages hold at least the tokens' bytes
    assert 0 < result["peak_tokens"] <= sum(len(r.prompt) + r.max_new_tokens for r in requests)
    assert table(rows).row_count == 4


def test_prefix_hit_rows_on_the_small_package(small_pkg, monkeypatch):
    package = small_pkg
    # Each timed pair starts with a full collection, a quarter of a second in a test process
    # holding the suite's packages: seven pairs would be most of this test.
    monkeypatch.setattr(registry.gc, "collect", lambda *args: 0)
    rows = ph.measure(package, ONE_ROUND, prefixes=(64, 128, 192), tail=16, cold_rounds={64: 1, 128: 1, 192: 1},
                      hit_rounds=1)
    assert [(m.benchmark, m.case) for m in rows] == [
        ("prefix_hit_ttft.hit_vs_cold", "prefix 64 + 16"),
        ("prefix_hit_ttft.hit_vs_cold", "prefix 128 + 16"),
        ("prefix_hit_ttft.hit_vs_cold", "prefix 192 + 16"),
        ("prefix_hit_ttft.hit_vs_1k_hit", "hit 128 vs 64"),
        ("prefix_hit_ttft.hit_vs_1k_hit", "hit 192 vs 64"),
        ("prefix_hit_ttft.restore_vs_1k", "restore 128 vs 64"),
        ("prefix_hit_ttft.restore_vs_1k", "restore 192 vs 64"),
        ("prefix_hit_ttft.pages_copied", "prefix 64"),
        ("prefix_hit_ttft.pages_copied", "prefix 128"),
        ("prefix_hit_ttft.pages_copied", "prefix 192"),
    ]
    for m in rows[:7]:
        assert m.unit == "ms" and m.baseline > 0 and m.candidate > 0
        assert m.ratio == pytest.approx(m.candidate / m.baseline, rel=1e-12)
    assert all(len(m.baseline_samples) == len(m.candidate_samples) == 1 for m in rows[:7])
    assert all(m.params["first_token_identical"] for m in rows[:3])
    # Pages the snapshots share: ceil(P / 64) entry pages plus ceil(P / 32) index-key pages.
    assert [m.baseline for m in rows[7:]] == [1 + 2, 2 + 4, 3 + 6]
    assert rows[6].params["shared_pages"] == [3, 9]
    for m in rows[7:]:
        check_counts(m, "pages")
        assert m.candidate == 0 and m.params["hydrate_copies"] == m.params["copy_on_write"] == 0
        assert m.params["session_hydrate_copies"] == 0
    with pytest.raises(ValueError, match="multiples"):
        ph.measure(package, ONE_ROUND, prefixes=(64, 100))


def test_indexer_reads_only_the_live_pages(tiny_recipe):
    """The context_scaling indexer rows: pages past the committed ones are never read."""
    from benchmarks import context_scaling as cs

    d = Dims.from_recipe(tiny_recipe)
    keys = torch.randn(256, d.index_head_dim, generator=torch.Generator().manual_seed(0))
    call = cs.IndexerCall(d, keys, 200, 1024, torch.Generator().manual_seed(1))
    assert call.block_table.shape == (1, 1024 // cs.PAGE_RECORDS) and call.pages_used == 4
    assert sorted(call.block_table[0].tolist()) == list(range(16))  # every page once, shuffled
    chosen = call()
    assert chosen.shape == (1, d.verify_width, d.index_topk) and bool((chosen >= 0).all())
    call.block_table[0, call.pages_used:] = -1  # no page: a read would fail
    assert torch.equal(call(), chosen)
    live = call.block_table[0, 0].item()
    call.cache[live] = 0xFF  # a live page poisoned: the choice changes, so the poison would show
    assert not torch.equal(call(), chosen)
