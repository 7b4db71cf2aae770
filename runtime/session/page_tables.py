"""A session's paged caches: which pages each slot holds, its block tables, and sharing.

Per pool, every slot holds a list of page ids in block-table order (page i covers the
slot's tokens [i * tokens_per_page, (i + 1) * tokens_per_page)), mirrored in a device
block table [slots + 1, pages_per_slot] (-1: no page) that replays copy rows from. The
scratch slot never holds a page, so padding rows read none and write none.

Before a pass runs on a slot, `ensure` gives it pages for every token the pass reads or
writes, and copies (copy-on-write) each page the pass may write that someone else still
holds. Pages entirely below the committed length are never written again (entries are
append-only), which is what lets a snapshot and several slots share them as they are.
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.errors import InputError
from b12x_toolchain.runtime.session.pages import PagePool, PagesExhausted


class PageTables:
    def __init__(self, pools: dict[str, PagePool], caches: dict[str, dict[str, torch.Tensor]], slots: int, device,
                 contiguous: bool = False):
        """contiguous: slot s always gets pages s * pages_per_slot + i, in order, so each slot's
        entries lie in one run of memory as in a per-slot cache (pools must hold every slot)."""
        self.pools, self.caches = pools, caches  # caches: pool -> cache name -> [pages, page_bytes]
        self.contiguous = contiguous
        for name, pool in pools.items():
            if contiguous and pool.count < slots * pool.pages_per_slot:
                raise ValueError(f"pool {name}: contiguous placement needs {slots * pool.pages_per_slot} pages "
                                 f"({slots} slots x {pool.pages_per_slot}), the pool has {pool.count}")
        self.held = {p: [[] for _ in range(slots + 1)] for p in pools}
        self.reserved = {p: [0] * (slots + 1) for p in pools}
        self.tables = {p: torch.full((slots + 1, pool.pages_per_slot), -1, dtype=torch.int32, device=device)
                       for p, pool in pools.items()}
        self.hydrate_copies = 0  # pages copied into a slot while hydrating a snapshot of another session
        self.snapshot_copies = 0  # partly filled pages a by-reference snapshot took a copy of

    # -- growth and copy-on-write -------------------------------------------------------------

    def _take(self, pool: str, slot: int, index: int | None = None) -> int:
        """A page for position `index` of the slot's block table (contiguous placement needs it)."""
        reserved = self.reserved[pool][slot] > 0
        place = slot * self.pools[pool].pages_per_slot + index if self.contiguous and index is not None else None
        page = self.pools[pool].take(reserved=reserved, page=place)
        self.reserved[pool][slot] -= reserved
        return page

    def _set(self, pool: str, slot: int, index: int, page: int) -> None:
        held = self.held[pool][slot]
        if index == len(held):
            held.append(page)
        else:
            held[index] = page
        self.tables[pool][slot, index] = page

    def shortfall(self, slot: int, committed: int, end: int, shared: int = 0) -> dict[str, int]:
        """New pages each pool must hand `slot` before it can hold tokens up to `end`.

        shared: an empty slot about to adopt a snapshot of that many tokens: its full pages
        will be shared, not handed out (its partly filled page is copied on the first write).
        """
        out = {}
        for name, pool in self.pools.items():
            held, first = self.held[name][slot], committed // pool.tokens_per_page
            need = pool.pages_for(end)
            writable = [p for p in held[first:need] if pool.refs[p] > 1]  # shared: copied before a write
            adopted = min(shared // pool.tokens_per_page, need) if not held else 0
            out[name] = max(need - len(held) - adopted, 0) + len(writable)
        return out

    def grow(self, rows: list[tuple[int, int, int]]) -> None:
        """`ensure` every (slot, committed, end) of a pass, after checking that all of them fit
        together: a shortfall raises before any page moves."""
        for slot, committed, end in rows:
            reason = self.never_fits(end)
            if reason is not None:
                raise PagesExhausted(f"slot {slot} cannot hold {end} tokens: {reason}")
        wanted = {name: 0 for name in self.pools}
        for slot, committed, end in rows:
            for name, count in self.shortfall(slot, committed, end).items():
                wanted[name] += max(count - self.reserved[name][slot], 0)
        for name, count in wanted.items():
            if count > self.pools[name].available:
                raise PagesExhausted(f"{count} more pages of pool {name} are needed for slots "
                                     f"{[r[0] for r in rows]}; {self.pools[name].available} are free and unreserved")
        for row in rows:
            self.ensure(*row)

    def ensure(self, slot: int, committed: int, end: int) -> None:
        """Pages for tokens [0, end) of `slot`; those a pass writes ([committed, end)) exclusive.
        The caller has checked that they can be had (`grow`)."""
        for name, pool in self.pools.items():
            held, first = self.held[name][slot], committed // pool.tokens_per_page
            for index in range(first, min(len(held), pool.pages_for(end))):
                if pool.refs[held[index]] > 1:
                    self._copy_on_write(name, slot, index)
            while len(held) < pool.pages_for(end):
                self._set(name, slot, len(held), self._take(name, slot, len(held)))

    def _copy_on_write(self, name: str, slot: int, index: int) -> None:
        pool, old = self.pools[name], self.held[name][slot][index]
        new = self._take(name, slot, index)
        for cache in self.caches[name].values():
            cache[new].copy_(cache[old])
        pool.release(old)
        pool.copied += 1
        self._set(name, slot, index, new)

    # -- reservations ------------------------------------------------------------------------

    def never_fits(self, tokens: int) -> str | None:
        for name, pool in self.pools.items():
            if pool.pages_for(tokens) > pool.count:
                return (f"{tokens} tokens need {pool.pages_for(tokens)} pages of pool {name} "
                        f"({pool.tokens_per_page} tokens each); the session has {pool.count}")
        return None

    def can_reserve(self, slot: int, committed: int, tokens: int, shared: int = 0) -> bool:
        short = self.shortfall(slot, committed, tokens, shared)
        return all(short[n] - self.reserved[n][slot] <= self.pools[n].available for n in self.pools)

    def reserve(self, slot: int, committed: int, tokens: int, shared: int = 0) -> None:
        """Make the slot's reservation exactly the pages it will need to grow to `tokens`
        (surplus goes back); raise, changing nothing, if they cannot be had."""
        if not self.can_reserve(slot, committed, tokens, shared):
            raise PagesExhausted(f"slot {slot}: the pages for {tokens} tokens cannot be had now")
        for name, count in self.shortfall(slot, committed, tokens, shared).items():
            extra = count - self.reserved[name][slot]
            if extra > 0:
                self.pools[name].reserve(extra)
            else:
                self.pools[name].unreserve(-extra)
            self.reserved[name][slot] = count

    # -- sharing -------------------------------------------------------------------------------

    def share(self, slot: int, tokens: int) -> dict[str, tuple[int, ...]]:
        """A snapshot's reference to the pages holding `slot`'s tokens [0, tokens).

        Full pages are retained as they are: the slot never writes them again. A partly
        filled last page is one the slot goes on writing, so the snapshot takes a copy
        of it in a free page (never a reserved one); PagesExhausted, changing nothing,
        when a pool has none.
        """
        if self.contiguous:
            raise PagesExhausted("contiguous placement gives every page to one slot; it shares none with snapshots")
        partial = {name: tokens % pool.tokens_per_page != 0 for name, pool in self.pools.items()}
        for name, pool in self.pools.items():
            if partial[name] and pool.available < 1:
                raise PagesExhausted(f"pool {name}: no free page for a snapshot's copy of a partly filled page")
        out = {}
        for name, pool in self.pools.items():
            pages = list(self.held[name][slot][: pool.pages_for(tokens)])
            full = pages[:-1] if partial[name] else pages
            for page in full:
                pool.retain(page)
            if partial[name]:
                copy = pool.take()
                for cache in self.caches[name].values():
                    cache[copy].copy_(cache[pages[-1]])
                pages[-1] = copy
                self.snapshot_copies += 1
            out[name] = tuple(pages)
        return out

    def release(self, pages: dict[str, tuple[int, ...]], evicted: bool = False) -> None:
        for name, ids in pages.items():
            for page in ids:
                self.pools[name].release(page, evicted)

    def adopt(self, slot: int, pages: dict[str, tuple[int, ...]]) -> None:
        """Point an empty slot's block tables at shared pages (no byte is copied)."""
        for name, ids in pages.items():
            if self.held[name][slot]:
                raise InputError(f"slot {slot} still holds pages of pool {name}; reset it first")
            for page in ids:
                self.pools[name].retain(page)
            self.held[name][slot] = list(ids)
            self.tables[name][slot, : len(ids)] = torch.tensor(ids, dtype=torch.int32, device=self.tables[name].device)  # one copy, not one per page

    def fill(self, slot: int, data: dict[str, dict[str, torch.Tensor]]) -> None:
        """Give an empty slot new pages holding `data` (pool -> cache name -> [n, page_bytes])."""
        counts = {name: next(iter(caches.values())).shape[0] for name, caches in data.items() if caches}
        for name, count in counts.items():
            if count > self.pools[name].available + self.reserved[name][slot]:
                raise PagesExhausted(f"slot {slot}: {count} pages of pool {name} wanted, "
                                     f"{self.pools[name].available} can be had")
        for name, caches in data.items():
            for index in range(counts.get(name, 0)):
                page = self._take(name, slot, index)
                for cache_name, rows in caches.items():
                    self.caches[name][cache_name][page].copy_(rows[index])
                self._set(name, slot, index, page)
                self.hydrate_copies += 1

    def release_slot(self, slot: int) -> None:
        """Return the slot's pages (those nobody else holds become free); reservations stay."""
        for name, pool in self.pools.items():
            for page in self.held[name][slot]:
                pool.release(page)
            self.held[name][slot] = []
            self.tables[name][slot] = -1

    def unreserve_slot(self, slot: int) -> None:
        for name, pool in self.pools.items():
            pool.unreserve(self.reserved[name][slot])
            self.reserved[name][slot] = 0

    def row(self, pool: str, slot: int) -> list[int]:
        """The slot's block-table row of `pool`, read from the host mirror (never the device)."""
        held = self.held[pool][slot]
        return held + [-1] * (self.pools[pool].pages_per_slot - len(held))

    def free_pages(self) -> dict[str, list[int]]:
        """Pages no slot or snapshot holds (their bytes are garbage a replay must never read)."""
        return {name: [p for p in range(pool.count) if not pool.refs[p]] for name, pool in self.pools.items()}

    def pool_stats(self) -> dict:
        """Each pool's PoolStats, by pool name."""
        return {name: pool.stats() for name, pool in self.pools.items()}

    def stats(self) -> dict:
        out = {name: stats.as_dict() for name, stats in self.pool_stats().items()}
        return {"pools": out, "hydrate_copies": self.hydrate_copies, "snapshot_copies": self.snapshot_copies}
