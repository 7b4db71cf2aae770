"""Prefix snapshots across ranks: rank 0's cache decides, every rank keeps its own shard's twin.

Each rank's caches hold its own shard, so each rank snapshots its own slot; but only rank
0's prefix cache (L1 budget, eviction, L2 lookups) chooses. Every snapshot rank 0 captures
or reads from L2 gets a number; the other ranks capture (or read from their own L2
directory) the twin of the same tokens under that number, hydrate it when rank 0 hydrates,
and drop it when it leaves rank 0's L1. Page pools change in the same order on every rank,
so a twin held by reference shares the same pages' counterparts.

A hit is used only when every rank could hydrate its twin (an agreement after each
hydration): a worker's L2 may lack a file rank 0 has (another byte budget, a crash between
two writes). Otherwise every rank empties the slot and the request prefills, as on a miss.
"""

from __future__ import annotations

from b12x_toolchain.runtime.errors import PagesExhausted
from b12x_toolchain.runtime.prefix.keys import token_bytes
from b12x_toolchain.runtime.prefix.snapshot import SnapshotError


class LeaderPrefixCache:
    """Rank 0's prefix cache, its choices sent to every other rank through `session` (a LeaderSession)."""

    def __init__(self, cache, session):
        self._cache, self._session = cache, session
        self._numbers: dict = {}  # snapshot (rank 0's) -> its number, while the other ranks keep a twin
        self._next = 0

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def _number(self, snap) -> tuple[int, bool]:
        """The snapshot's number, and whether it is new."""
        if snap in self._numbers:
            return self._numbers[snap], False
        self._numbers[snap], self._next = self._next, self._next + 1
        return self._numbers[snap], True

    def _drop_gone(self) -> None:
        kept = set(self._cache.l1.snapshots()) if self._cache.l1 is not None else set()
        gone = [snap for snap in self._numbers if snap not in kept]
        if gone:
            self._session.record("snapshot_drop", [self._numbers.pop(snap) for snap in gone])

    def store(self, session, slot: int, tokens, logits=None):
        drops = self._cache.stats.l2_write_drops
        snap = self._cache.store(self._session.local, slot, tokens, logits)
        if snap is not None:
            number, _ = self._number(snap)
            # The other ranks write to their L2 what rank 0 queued for its own (not what its full queue dropped).
            to_l2 = self._cache.l2 is not None and self._cache.stats.l2_write_drops == drops
            self._session.record("snapshot_capture", number, slot, list(tokens), snap.pages is not None, to_l2)
        self._drop_gone()
        return snap

    def restore(self, session, slot: int, prompt):
        hit = self._cache.restore(self._session.local, slot, prompt)
        if hit is not None:
            number, new = self._number(hit.snapshot)
            if new:  # read from rank 0's L2: every rank reads its own file of the same tokens
                self._session.record("snapshot_load", number, slot, hit.snapshot.token_ids)
            else:
                self._session.record("snapshot_hydrate", number, slot)
            if not self._session.agree(True):
                self._session.reset_slot(slot)
                self._cache.forget(hit)
                hit = None
        self._drop_gone()
        return hit

    def release_pages(self, wanted, keep=()) -> int:
        dropped = self._cache.release_pages(wanted, keep)
        self._drop_gone()
        return dropped


class FollowerSnapshots:
    """A worker's twins of rank 0's snapshots, by number, and its own L2 directory (or None)."""

    def __init__(self, session, codec, l2=None):
        self.session, self.codec, self.l2 = session, codec, l2
        self.twins: dict[int, object] = {}

    def capture(self, number: int, slot: int, tokens: list[int], by_reference: bool, to_l2: bool) -> None:
        twin = self.codec.capture(self.session, slot, tokens, by_reference=by_reference)
        if to_l2 and self.l2 is not None:
            self.l2.put(self.codec.materialized(twin))
        self.twins[number] = twin

    def hydrate(self, follower, number: int, slot: int) -> None:
        twin = self.twins.get(number)
        follower.last_ok = twin is not None and self._hydrate(slot, twin)

    def load(self, follower, number: int, slot: int, tokens: list[int]) -> None:
        data = token_bytes(tokens)
        twin = self.l2.lookup(self.codec.identity, data, lambda n: n == len(tokens)) if self.l2 is not None else None
        if twin is not None:
            self.twins[number] = twin
        follower.last_ok = twin is not None and self._hydrate(slot, twin)

    def _hydrate(self, slot: int, twin) -> bool:
        try:
            self.codec.hydrate(self.session, slot, twin)
            return True
        except (SnapshotError, PagesExhausted):
            self.session.reset_slot(slot)
            return False

    def drop(self, numbers: list[int]) -> None:
        for number in numbers:
            twin = self.twins.pop(number, None)
            if twin is not None:
                twin.release()
