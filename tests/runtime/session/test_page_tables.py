"""The page allocator: growth, copy-on-write, reservations, sharing, and what fails cleanly.

Plain tensors stand in for a session's paged caches: two caches share one pool, as the
layers owning one cache kind do, so every page operation must touch both.
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.errors import PagesExhausted
from b12x_toolchain.runtime.session.page_tables import PageTables
from b12x_toolchain.runtime.session.pages import PagePool

TOKENS_PER_PAGE, PAGES_PER_SLOT = 4, 8


def tables(count: int = 6, slots: int = 3) -> PageTables:
    pool = PagePool("entry_pages", count, TOKENS_PER_PAGE, PAGES_PER_SLOT, page_bytes=8)
    caches = {"a": torch.zeros(count, 4, dtype=torch.uint8), "b": torch.zeros(count, 4, dtype=torch.uint8)}
    return PageTables({"entry_pages": pool}, {"entry_pages": caches}, slots, "cpu")


def write(t: PageTables, slot: int, value: int) -> None:
    """What a pass does: write into every page the slot holds (the caller ensured exclusivity)."""
    for page in t.held["entry_pages"][slot]:
        for cache in t.caches["entry_pages"].values():
            cache[page] = value


def test_pages_follow_tokens_and_the_block_table_mirrors_them():
    t = tables()
    t.grow([(0, 0, 5)])  # 5 tokens: 2 pages of 4
    assert t.held["entry_pages"][0] == [0, 1]
    assert t.tables["entry_pages"][0].tolist() == [0, 1] + [-1] * (PAGES_PER_SLOT - 2)
    t.grow([(1, 0, 3), (0, 5, 9)])
    assert t.held["entry_pages"][1] == [2] and t.held["entry_pages"][0] == [0, 1, 3]
    assert t.tables["entry_pages"][3].tolist() == [-1] * PAGES_PER_SLOT  # the scratch slot holds none
    t.release_slot(0)
    assert t.free_pages()["entry_pages"] == [0, 1, 3, 4, 5]
    assert t.tables["entry_pages"][0].tolist() == [-1] * PAGES_PER_SLOT


def test_a_shortfall_raises_before_any_page_moves():
    t = tables(count=3)
    t.grow([(0, 0, 4)])
    before = ([list(h) for h in t.held["entry_pages"]], t.tables["entry_pages"].clone())
    with pytest.raises(PagesExhausted, match=r"3 more pages of pool entry_pages are needed .* 2 are free"):
        t.grow([(1, 0, 8), (2, 0, 4)])  # each alone would fit; together they do not
    assert [list(h) for h in t.held["entry_pages"]] == before[0]
    assert torch.equal(t.tables["entry_pages"], before[1])


def test_a_request_that_can_never_fit_is_named():
    t = tables(count=6)
    assert t.never_fits(24) is None
    assert t.never_fits(25) == "25 tokens need 7 pages of pool entry_pages (4 tokens each); the session has 6"


def test_shared_full_pages_are_adopted_and_a_partial_page_is_copied_for_the_snapshot():
    t = tables(count=8)
    t.grow([(0, 0, 6)])  # page 0 full, page 1 half full
    write(t, 0, 7)
    shared = t.share(0, 6)
    assert shared["entry_pages"][0] == 0  # the full page is the slot's own
    copy = shared["entry_pages"][1]
    assert copy not in t.held["entry_pages"][0] and t.snapshot_copies == 1
    assert torch.equal(t.caches["entry_pages"]["a"][copy], t.caches["entry_pages"]["a"][1])
    t.adopt(1, shared)
    assert t.held["entry_pages"][1] == list(shared["entry_pages"]) and t.hydrate_copies == 0
    # Slot 1 continues at token 6: the shared partial page is copied before it is written.
    t.grow([(1, 6, 8)])
    assert t.held["entry_pages"][1][0] == 0 and t.held["entry_pages"][1][1] not in shared["entry_pages"]
    assert t.pools["entry_pages"].copied == 1
    assert t.pools["entry_pages"].refs[0] == 3  # page 0 (below the committed length) stays shared


def test_copy_on_write_isolates_every_holder():
    t = tables(count=8)
    t.grow([(0, 0, 4)])
    write(t, 0, 5)
    t.adopt(1, t.share(0, 4))  # a full page: shared by the slot, the snapshot and slot 1
    t.grow([(1, 2, 4)])  # slot 1 is told to write tokens 2..3: its page must become its own
    page = t.held["entry_pages"][1][0]
    assert page != t.held["entry_pages"][0][0]
    t.caches["entry_pages"]["a"][page] = 1
    assert int(t.caches["entry_pages"]["a"][t.held["entry_pages"][0][0]].max()) == 5


def test_reservations_set_pages_aside_and_are_consumed_by_growth():
    t = tables(count=4)
    t.reserve(0, 0, 12)  # three pages set aside for slot 0
    assert t.pools["entry_pages"].available == 1
    assert not t.can_reserve(1, 0, 8)
    with pytest.raises(PagesExhausted):
        t.grow([(1, 0, 8)])
    t.grow([(0, 0, 12)])
    assert t.reserved["entry_pages"][0] == 0 and t.pools["entry_pages"].reserved == 0
    t.reserve(0, 12, 12)  # nothing more needed: nothing reserved
    assert t.pools["entry_pages"].available == 1
    t.release_slot(0)
    t.unreserve_slot(0)
    assert t.pools["entry_pages"].available == 4


def test_released_references_free_a_page_only_when_the_last_holder_lets_go():
    t = tables(count=4)
    t.grow([(0, 0, 4)])
    snapshot = t.share(0, 4)
    t.release_slot(0)
    assert t.free_pages()["entry_pages"] == [1, 2, 3]  # the snapshot still holds page 0
    t.release(snapshot, evicted=True)
    assert t.free_pages()["entry_pages"] == [0, 1, 2, 3]
    assert t.pools["entry_pages"].stats().evicted == 1
