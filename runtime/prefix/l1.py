"""L1: snapshots in memory, an LRU bounded by bytes and by entries.

A lookup returns the longest stored prefix of a prompt: candidate lengths are filtered by
token hash (one pass over the prompt's bytes for all stored lengths), then compared token
for token, so a hash collision costs a comparison and never returns a wrong prefix. A hit
refreshes recency. Storing a snapshot drops the stored snapshots it dominates (strict
prefixes of it, same package): a conversation that grew past them will not come back to
them, and the L2 tier still has them if it does.

Snapshots are immutable and handed out as objects. One that holds a session's pages by
reference is L1's to release: dropping it (eviction, pruning, clear, or declining to
store it) releases its pages, which return to the pool once no slot holds them either,
so eviction never frees a page a live request references. One lock guards everything; nothing slow
(no I/O, no tensor copies) runs under it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable

from b12x_toolchain.runtime.package.kinds import TOKEN_BYTES
from b12x_toolchain.runtime.prefix import keys as prefix_keys
from b12x_toolchain.runtime.prefix.snapshot import Snapshot


@dataclass
class L1Stats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    insertions: int = 0
    evictions: int = 0
    prefix_prunes: int = 0  # dropped because a longer snapshot of the same prefix arrived
    too_large: int = 0  # larger than the whole byte budget: not stored
    hash_collisions: int = 0  # hash matched, tokens did not

    def as_dict(self) -> dict:
        return asdict(self)


class L1Cache:
    def __init__(self, max_bytes: int, max_entries: int = 64):
        if max_bytes < 0 or max_entries < 1:
            raise ValueError(f"L1 needs max_bytes >= 0 and max_entries >= 1, got {max_bytes}, {max_entries}")
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.stats = L1Stats()
        self._lock = threading.Lock()
        self._lru: OrderedDict[int, Snapshot] = OrderedDict()  # entry id -> snapshot, oldest first
        self._buckets: dict[tuple, list[int]] = {}  # (identity key, length, token hash) -> entry ids
        self._lengths: dict[str, dict[int, int]] = {}  # identity key -> length -> entry count
        self._next = 0
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._lru)

    def snapshots(self) -> list[Snapshot]:
        """Stored snapshots, least recently used first."""
        with self._lock:
            return list(self._lru.values())

    def _find(self, key: str, prompt: bytes, lengths, usable) -> tuple[int, Snapshot] | None:
        hashes = prefix_keys.prefix_hashes(key, prompt, lengths)
        for length in sorted(lengths, reverse=True):
            for entry in self._buckets.get((key, length, hashes[length]), ()):
                snap = self._lru[entry]
                if prompt[: TOKEN_BYTES * length] != snap.tokens:
                    self.stats.hash_collisions += 1
                elif usable(snap):
                    return entry, snap
        return None

    def lookup(self, key: str, prompt: bytes, usable: Callable[[Snapshot], bool] = lambda s: True) -> Snapshot | None:
        """Longest stored snapshot of package `key` whose tokens start `prompt` and that `usable` accepts."""
        with self._lock:
            self.stats.lookups += 1
            lengths = [n for n in self._lengths.get(key, {}) if TOKEN_BYTES * n <= len(prompt)]
            found = self._find(key, prompt, lengths, usable) if lengths else None
            if found is None:
                self.stats.misses += 1
                return None
            self._lru.move_to_end(found[0])
            self.stats.hits += 1
            return found[1]

    def peek(self, key: str, prompt: bytes, usable: Callable[[Snapshot], bool] = lambda s: True) -> Snapshot | None:
        """What `lookup` would return, without counting it or refreshing recency."""
        with self._lock:
            lengths = [n for n in self._lengths.get(key, {}) if TOKEN_BYTES * n <= len(prompt)]
            found = self._find(key, prompt, lengths, usable) if lengths else None
            return found[1] if found is not None else None

    def insert(self, snap: Snapshot) -> bool:
        """Store `snap` (or refresh an identical one); False when it is larger than the budget."""
        key, size = snap.identity.key, snap.nbytes
        with self._lock:
            if size > self.max_bytes:
                self.stats.too_large += 1
                snap.release()
                return False
            for entry in self._buckets.get((key, snap.length, snap.token_hash), ()):
                if self._lru[entry].tokens == snap.tokens:
                    self._lru.move_to_end(entry)
                    if self._lru[entry] is not snap:
                        snap.release()
                    return True
            shorter = [n for n in self._lengths.get(key, {}) if n < snap.length]
            while shorter:  # each round drops one dominated entry, then looks again
                found = self._find(key, snap.tokens, shorter, lambda s: True)
                if found is None:
                    break
                self._remove(found[0])
                self.stats.prefix_prunes += 1
                shorter = [n for n in self._lengths.get(key, {}) if n < snap.length]
            while self._lru and (self._bytes + size > self.max_bytes or len(self._lru) >= self.max_entries):
                self._remove(next(iter(self._lru)))
                self.stats.evictions += 1
            entry, self._next = self._next, self._next + 1
            self._lru[entry] = snap
            self._buckets.setdefault((key, snap.length, snap.token_hash), []).append(entry)
            counts = self._lengths.setdefault(key, {})
            counts[snap.length] = counts.get(snap.length, 0) + 1
            self._bytes += size
            self.stats.insertions += 1
            return True

    def _remove(self, entry: int) -> None:
        snap = self._lru.pop(entry)
        bucket_key = (snap.identity.key, snap.length, snap.token_hash)
        bucket = self._buckets[bucket_key]
        bucket.remove(entry)
        if not bucket:
            del self._buckets[bucket_key]
        counts = self._lengths[snap.identity.key]
        counts[snap.length] -= 1
        if not counts[snap.length]:
            del counts[snap.length]
        if not counts:
            del self._lengths[snap.identity.key]
        self._bytes -= snap.nbytes
        snap.release()

    def discard(self, snap: Snapshot) -> bool:
        """Drop `snap` itself, if stored (a hit the caller could not use); whether it was."""
        with self._lock:
            entry = next((e for e, stored in self._lru.items() if stored is snap), None)
            if entry is not None:
                self._remove(entry)
            return entry is not None

    def release_pages(self, wanted, keep=()) -> int:
        """Evict the least recently used snapshots that hold pages by reference (but those in
        `keep`) until `wanted()` is true or none is left; returns how many were dropped."""
        dropped = 0
        with self._lock:
            for entry in [e for e, snap in self._lru.items() if snap.pages is not None and snap not in keep]:
                if wanted():
                    break
                self._remove(entry)
                self.stats.evictions += 1
                dropped += 1
        return dropped

    def clear(self) -> None:
        with self._lock:
            for entry in list(self._lru):
                self._remove(entry)
