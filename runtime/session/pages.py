"""Page pools: the runtime's allocator for callers who do not bring their own pages.

A paged cache kind (compressed entries, index keys) has one pool per session; every cache
of the pool (one per layer owning that kind) shares its page ids, so page p of a row's
block table holds that row's entries for tokens [p * tokens_per_page, (p + 1) *
tokens_per_page) in every layer. A page is reference counted: a slot holding it counts
one, so does a prefix snapshot holding it. Entries are append-only, so a page below a
slot's committed length is never written again and can be shared as it is; a page that
a pass is about to write while someone else holds it is copied first (copy-on-write).

Reservations let a serving engine admit a request only when the pages it may ever need
can be had: reserved pages are set aside from the free list and handed to that slot as
its context grows.
"""

from __future__ import annotations

import heapq
from array import array
from dataclasses import asdict, dataclass

from b12x_toolchain.runtime.errors import PagesExhausted  # noqa: F401  (re-exported)


@dataclass
class PoolStats:
    pages: int = 0
    in_use: int = 0  # referenced by a slot or a snapshot
    free: int = 0
    shared: int = 0  # referenced more than once
    reserved: int = 0
    allocated: int = 0  # handed out, ever
    copied: int = 0  # copy-on-write copies
    evicted: int = 0  # freed because the last snapshot holding them was dropped

    def as_dict(self) -> dict:
        return asdict(self)


class PagePool:
    """Page ids 0 .. count - 1 of one pool; the lowest free id is handed out first.

    A pool may hold millions of pages (every slot at a long max_seq_len), so its bookkeeping
    is 4 bytes a page (reference counts in an int32 array) plus the ids handed out and given
    back since (a heap); ids from `fresh` up were never handed out, and are free.
    """

    def __init__(self, name: str, count: int, tokens_per_page: int, pages_per_slot: int, page_bytes: int):
        if count < 1:
            raise ValueError(f"pool {name}: {count} pages; expected at least 1")
        self.name, self.count = name, count
        self.tokens_per_page, self.pages_per_slot, self.page_bytes = tokens_per_page, pages_per_slot, page_bytes
        self.refs = array("i", bytes(4 * count))
        self._returned: list[int] = []  # free ids below `fresh`, a heap
        self.fresh = 0
        self.reserved = 0
        self.shared = 0  # pages referenced more than once, counted as it changes: stats never scan refs
        self.allocated = self.copied = self.evicted = 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_page)

    @property
    def available(self) -> int:
        """Free pages nobody has reserved."""
        return self.free_count - self.reserved

    @property
    def free_count(self) -> int:
        return len(self._returned) + self.count - self.fresh

    def take(self, reserved: bool = False, page: int | None = None) -> int:
        """The lowest free page, or `page` if given (it must be free): a placement policy's choice."""
        if not self.free_count or (not reserved and self.available < 1):
            raise PagesExhausted(f"pool {self.name}: all {self.count} pages are in use or reserved")
        if page is not None and self.refs[page]:
            raise ValueError(f"pool {self.name}: page {page} is in use")
        if reserved:
            self.reserved -= 1
        if page is None:
            page = heapq.heappop(self._returned) if self._returned else self._fresh_page()
        elif page >= self.fresh:  # the ids it skips stay free: given back, as it were
            for skipped in range(self.fresh, page):
                heapq.heappush(self._returned, skipped)
            self.fresh = page + 1
        else:
            self._returned.remove(page)
            heapq.heapify(self._returned)
        self.refs[page] = 1
        self.allocated += 1
        return page

    def _fresh_page(self) -> int:
        self.fresh += 1
        return self.fresh - 1

    def retain(self, page: int) -> None:
        if self.refs[page] < 1:
            raise ValueError(f"pool {self.name}: page {page} is free; only a held page can be shared")
        self.refs[page] += 1
        self.shared += self.refs[page] == 2

    def release(self, page: int, evicted: bool = False) -> None:
        if self.refs[page] < 1:
            raise ValueError(f"pool {self.name}: page {page} is released more often than it was held")
        self.refs[page] -= 1
        self.shared -= self.refs[page] == 1
        if not self.refs[page]:
            heapq.heappush(self._returned, page)
            self.evicted += evicted

    def reserve(self, count: int) -> None:
        if count > self.available:
            raise PagesExhausted(f"pool {self.name}: {count} pages wanted, {self.available} can be had")
        self.reserved += count

    def unreserve(self, count: int) -> None:
        self.reserved -= count

    def stats(self) -> PoolStats:
        return PoolStats(self.count, self.count - self.free_count, self.free_count, self.shared,
                         self.reserved, self.allocated, self.copied, self.evicted)
