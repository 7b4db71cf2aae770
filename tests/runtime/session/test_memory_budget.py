"""The default page pools: what a share of the device's free memory holds, at most every slot
at max_seq_len; one max-length request must fit, or the session says what it would need."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from b12x_toolchain.runtime.session import memory
from b12x_toolchain.runtime.session import session as session_module
from b12x_toolchain.runtime.session.pages import PagePool

SLOTS = 8
FRACTION = 0.5


@pytest.fixture(scope="module")
def geometry(fused_pkg):
    """Per pool (tokens per page, pages per slot, bytes per page), the bytes of one max-length
    request, and the session's other buffers (from a session whose budget holds every slot)."""
    session = fused_pkg.session(slots=SLOTS)
    pools = {name: (p.tokens_per_page, p.pages_per_slot, p.page_bytes) for name, p in session.pools.items()}
    assert {name: p.count for name, p in session.pools.items()} == {n: SLOTS * g[1] for n, g in pools.items()}
    one = sum(per_slot * page for _, per_slot, page in pools.values())
    return pools, one, session.memory_budget["other_bytes"]


def with_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(session_module, "free_bytes", lambda device: free)


def test_a_budget_below_every_slot_at_max_seq_len_holds_its_own_pages(fused_pkg, geometry, monkeypatch):
    pools, one, other = geometry
    budget = one * 5 // 2  # two and a half max-length requests, for 8 slots
    with_free(monkeypatch, int((other + budget) / FRACTION) + 1)
    session = fused_pkg.session(slots=SLOTS, memory_fraction=FRACTION)
    assert session.memory_budget["other_bytes"] == other and session.memory_budget["budget_bytes"] >= budget
    per_token = sum(page / tokens for tokens, _, page in pools.values())
    tokens = int(session.memory_budget["budget_bytes"] // per_token)
    counts = {name: p.count for name, p in session.pools.items()}
    assert counts == {name: tokens // g[0] for name, g in pools.items()}
    assert all(g[1] * 2 < counts[name] < g[1] * SLOTS for name, g in pools.items())
    assert all(next(iter(c.values())).shape[0] == counts[p] for p, c in session.pages.caches.items())


def test_contiguous_placement_keeps_every_slots_pages_whatever_the_budget(fused_pkg, geometry, monkeypatch):
    pools, one, other = geometry
    with_free(monkeypatch, other + one)
    session = fused_pkg.session(slots=SLOTS, contiguous=True)
    assert {name: p.count for name, p in session.pools.items()} == {n: SLOTS * g[1] for n, g in pools.items()}


def test_a_budget_too_small_for_one_max_length_request_says_what_it_needs(fused_pkg, geometry, monkeypatch):
    pools, one, other = geometry
    with_free(monkeypatch, int((other + one // 2) / FRACTION))
    pages = ", ".join(rf"{g[1]} pages of pool {name}" for name, g in pools.items())
    per_page = ", ".join(rf"{g[2]} in pool {name}" for name, g in pools.items())
    with pytest.raises(ValueError, match=rf"the page pools' memory budget is \d+ bytes \(0.5 of \d+ bytes free on "
                                         rf"cpu, less {other} bytes of the session's other buffers\); bytes per "
                                         rf"page: {per_page}; one request of max_seq_len 1024 tokens needs "
                                         rf"{pages} \({one} bytes\)"):
        fused_pkg.session(slots=SLOTS, memory_fraction=FRACTION)


@pytest.mark.parametrize("short", [1, 40_000])
def test_a_budget_too_small_says_by_how_many_bytes(fused_pkg, geometry, monkeypatch, short):
    """The bytes missing from the budget, the memory to free for them (the fraction of it the
    budget gets) and the memory_fraction that would hold one request."""
    _, one, other = geometry
    free = 2 * (other + one - short)  # FRACTION of it is exactly `short` bytes below one request
    with_free(monkeypatch, free)
    fits = math.ceil((one + other) / free * 1000) / 1000
    with pytest.raises(ValueError, match=rf" \({one} bytes\): {short} bytes short. Free {2 * short} bytes of memory, "
                                         rf"raise memory_fraction to at least {fits}, or give pages or cache_bytes$"):
        fused_pkg.session(slots=SLOTS, memory_fraction=FRACTION)
    with_free(monkeypatch, free + 2 * short)  # the memory it said to free: one request fits, to the byte
    session = fused_pkg.session(slots=SLOTS, memory_fraction=FRACTION)
    assert session.memory_budget["budget_bytes"] == one
    assert {name: p.count for name, p in session.pools.items()} == {name: p.pages_per_slot
                                                                   for name, p in session.pools.items()}


def test_a_budget_the_other_buffers_outgrow_counts_them_in_what_is_short(fused_pkg, geometry, monkeypatch):
    _, one, other = geometry
    with_free(monkeypatch, other)  # half the other buffers: the budget itself stops at 0
    short = one + other - other // 2
    # No memory_fraction holds it: the other buffers alone are more than the memory free.
    with pytest.raises(ValueError, match=rf"memory budget is 0 bytes .* {short} bytes short. Free {2 * short} "
                                         rf"bytes of memory, or give pages or cache_bytes$"):
        fused_pkg.session(slots=SLOTS, memory_fraction=FRACTION)


@pytest.mark.parametrize("kwargs, message", [
    ({"memory_fraction": 0.0}, r"memory_fraction=0.0: expected a number in \(0, 1\]"),
    ({"memory_fraction": 1.5}, r"memory_fraction=1.5: expected a number in \(0, 1\]"),
    ({"memory_fraction": 0.5, "pages": 4}, "memory_fraction sizes the pools when neither pages nor cache_bytes"),
    ({"memory_fraction": 0.5, "contiguous": True}, "memory_fraction does not apply to contiguous=True"),
])
def test_memory_fraction_is_checked(fused_pkg, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fused_pkg.session(slots=1, **kwargs)


def test_the_default_fraction_is_smaller_on_cpu_than_on_cuda():
    assert memory.default_fraction(torch.device("cuda")) == 0.9
    assert memory.default_fraction(torch.device("cpu")) == 0.25
    assert 0 < memory.free_bytes(torch.device("cpu"))


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_large_cpu_buffers_are_zeros_committed_as_they_are_written():
    before = _rss()
    buffer = memory.zeros((256, 1 << 20), torch.uint8, torch.device("cpu"))
    buffer[3, :10] = 7
    assert _rss() - before < 32 << 20  # not the 256 MiB torch.zeros would have written
    assert buffer[3, :12].tolist() == [7] * 10 + [0, 0] and not buffer[200].any()
    small = memory.zeros((4, 4), torch.float32, torch.device("cpu"))
    assert small.dtype == torch.float32 and not small.any()


def test_a_pool_of_millions_of_pages_keeps_four_bytes_a_page_and_hands_out_the_lowest_free_id():
    pool = PagePool("entry_pages", 3 << 20, 64, 1 << 14, 3456)
    assert pool.refs.itemsize == 4 and len(pool.refs) == 3 << 20 and pool.stats().free == 3 << 20
    assert [pool.take() for _ in range(3)] == [0, 1, 2]
    assert pool.take(page=6) == 6  # a placement's choice: 3, 4 and 5 stay free
    pool.release(1)
    assert [pool.take() for _ in range(3)] == [1, 3, 4]
    pool.retain(2)
    pool.retain(2)
    stats = pool.stats()
    assert (stats.in_use, stats.free, stats.shared) == (6, (3 << 20) - 6, 1)
    pool.release(2)
    pool.release(2)
    assert pool.stats().shared == 0 and pool.take() == 5 and pool.take() == 7
