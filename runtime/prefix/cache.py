"""The prefix cache a decoder consults: L1 then L2, hydration, snapshot boundaries, stats.

`restore` finds the longest stored snapshot whose tokens start the prompt — L1 first, then
L2 for anything longer — and hydrates it into the slot; the caller prefills only the rest.
A snapshot as long as the prompt itself is an exact hit: its stored logits give the first
token, nothing is replayed. An L2 hit is promoted into L1.

`store` captures a slot at a boundary the decoder reports: the end of the prompt, and
every `every` tokens. `every` must be a multiple of the prefill chunk: a snapshot is
only taken where a chunk ends, because shrinking a chunk to land on a boundary would
change the floating-point results of everything after it. A prefill resumed from a
snapshot at a multiple of the chunk replays exactly the chunks a cold prefill would, so
its logits are bitwise those of the cold prefill; resumed from anywhere else (an earlier
prompt's end) its chunks start elsewhere and agree with a cold prefill only to float
rounding — while still being bitwise the continuation of the snapshotted slot.

Snapshots go to L1 at once and to L2 through one background writer (`write_behind`),
which serialises and fsyncs off the decoding thread; when `max_pending_writes` are
queued, further L2 writes are dropped and counted. `flush()` waits for the queue.

The package's capability flags gate everything: without `supports_prefix_snapshot` (or
if the codec does not cover every cache) lookups miss and nothing is stored; without
`supports_rotating_cache_snapshot`, snapshots whose window rings have wrapped are neither
stored nor used. A missing flag counts as off.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import asdict, dataclass

from b12x_toolchain.runtime.errors import PagesExhausted
from b12x_toolchain.runtime.package.kinds import TOKEN_BYTES
from b12x_toolchain.runtime.prefix.keys import token_bytes
from b12x_toolchain.runtime.prefix.l1 import L1Cache
from b12x_toolchain.runtime.prefix.l2 import L2Store
from b12x_toolchain.runtime.prefix.snapshot import LayoutError, Snapshot, SnapshotCodec, SnapshotError


@dataclass
class PrefixStats:
    lookups: int = 0
    exact_hits: int = 0
    prefix_hits: int = 0
    misses: int = 0
    insertions: int = 0  # snapshots captured and handed to the tiers
    prefill_tokens_saved: int = 0  # sum of the hit lengths
    disabled_misses: int = 0  # misses because snapshots are off for this package
    hydrate_errors: int = 0  # a found snapshot did not fit the package: treated as a miss
    l2_write_drops: int = 0  # the background writer's queue was full
    l2_write_failures: int = 0  # the background writer hit an unexpected error (see last_write_error)
    page_drops: int = 0  # not stored: no free page for a by-reference snapshot's partly filled page

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Hit:
    snapshot: Snapshot
    tier: str  # "l1" or "l2"
    exact: bool  # the snapshot holds the whole prompt

    @property
    def length(self) -> int:
        return self.snapshot.length


class PrefixCache:
    def __init__(self, package, l1_bytes: int = 1 << 30, l1_entries: int = 64, l2_dir=None,
                 l2_bytes: int = 16 << 30, every: int | None = None, end_of_prompt: bool = True,
                 write_behind: bool = True, max_pending_writes: int = 4, l2_scrub: bool = True):
        chunk = package.passes["prefill"].width
        if every is not None and (every < 1 or every % chunk):
            raise ValueError(f"every={every}: snapshots are taken where prefill chunks end, "
                             f"so it must be a positive multiple of the prefill chunk {chunk}")
        self.every, self.end_of_prompt = every, end_of_prompt
        self.stats = PrefixStats()
        self._lock = threading.Lock()
        caps = package.manifest.model.capabilities or {}
        self.enabled = caps.get("supports_prefix_snapshot") is True
        self.rotating = caps.get("supports_rotating_cache_snapshot") is True
        self.reason = None if self.enabled else "the package does not declare supports_prefix_snapshot"
        self.codec = None
        if self.enabled:
            try:
                self.codec = SnapshotCodec(package)
            except LayoutError as exc:
                self.enabled, self.reason = False, str(exc)
        self.l1 = L1Cache(l1_bytes, l1_entries) if self.enabled and l1_bytes > 0 else None
        self.l2 = L2Store(l2_dir, l2_bytes, scrub=l2_scrub) if self.enabled and l2_dir is not None else None
        self._queue = self._thread = None
        self.last_write_error = None
        if self.l2 is not None and write_behind:
            self._queue = queue.Queue(maxsize=max_pending_writes)
            self._thread = threading.Thread(target=self._write_loop, name="b12x-prefix-l2-writer", daemon=True)
            self._thread.start()

    def configuration(self) -> dict:
        """The tiers as plain data: whether snapshots are taken at all, and each tier's budget."""
        return {"enabled": self.enabled, "l1_bytes": self.l1.max_bytes if self.l1 is not None else 0,
                "l2_dir": str(self.l2.dir) if self.l2 is not None else None,
                "l2_bytes": self.l2.max_bytes if self.l2 is not None else 0}

    # -- policy ---------------------------------------------------------------------------

    def _usable(self, length: int) -> bool:
        return length >= 1 and (self.rotating or not self.codec.wrapped(length))

    def boundary(self, length: int, prompt_len: int) -> bool:
        """Whether the decoder should store a snapshot after prefilling `length` of `prompt_len` tokens."""
        if not self.enabled or not self._usable(length):
            return False
        return (self.end_of_prompt and length == prompt_len) or bool(self.every and length % self.every == 0)

    # -- lookup ---------------------------------------------------------------------------

    def _find(self, prompt: bytes) -> Hit | None:
        n = len(prompt) // TOKEN_BYTES
        usable = lambda s: self._usable(s.length) and (s.length < n or s.logits is not None)
        best = None
        if self.l1 is not None:
            snap = self.l1.lookup(self.codec.identity.key, prompt, usable)
            best = Hit(snap, "l1", snap.length == n) if snap is not None else None
        if self.l2 is not None and (best is None or best.length < n):
            floor = best.length if best else 0
            snap = self.l2.lookup(self.codec.identity, prompt, lambda length: length > floor and self._usable(length))
            if snap is not None and usable(snap) and self._fits(snap):
                if self.l1 is not None:
                    self.l1.insert(snap)
                best = Hit(snap, "l2", snap.length == n)
        return best

    def _fits(self, snap: Snapshot) -> bool:
        """A sound file of this package whose records still do not fit it is a bug to count, not to cache."""
        try:
            self.codec.check(snap)
            return True
        except SnapshotError:
            with self._lock:
                self.stats.hydrate_errors += 1
            return False

    def restore(self, session, slot: int, prompt) -> Hit | None:
        """Hydrate the longest stored prefix of `prompt` into `slot`; None (slot untouched) on a miss."""
        data = token_bytes(prompt)
        hit = self._find(data) if self.enabled else None
        if hit is not None:
            try:
                self.codec.hydrate(session, slot, hit.snapshot)
            except (SnapshotError, PagesExhausted):
                session.reset_slot(slot)
                with self._lock:
                    self.stats.hydrate_errors += 1
                hit = None
        with self._lock:
            self.stats.lookups += 1
            if hit is None:
                self.stats.misses += 1
                self.stats.disabled_misses += not self.enabled
            else:
                self.stats.prefill_tokens_saved += hit.length
                if hit.exact:
                    self.stats.exact_hits += 1
                else:
                    self.stats.prefix_hits += 1
        return hit

    # -- store ----------------------------------------------------------------------------

    def store(self, session, slot: int, tokens, logits=None) -> Snapshot | None:
        """Capture `slot` (holding exactly `tokens`) into L1 and L2; None when snapshots are off."""
        if not self.enabled or not self._usable(len(tokens)):
            return None
        try:
            by_reference = self.l1 is not None and not session.pages.contiguous
            snap = self.codec.capture(session, slot, tokens, logits, by_reference=by_reference)
        except PagesExhausted:  # no free page for the copy of a partly filled page: skip this one
            with self._lock:
                self.stats.page_drops += 1
            return None
        if self.l2 is not None:  # L2 stores whole pages: copied now, while the slot still holds them
            stored = self.codec.materialized(snap)
        if self.l1 is not None:
            self.l1.insert(snap)
        if self.l2 is not None:
            if self._queue is None:
                self.l2.put(stored)
            else:
                try:
                    self._queue.put_nowait(stored)
                except queue.Full:
                    with self._lock:
                        self.stats.l2_write_drops += 1
        with self._lock:
            self.stats.insertions += 1
        return snap

    def forget(self, hit: Hit) -> None:
        """A hit its caller could not use after all (another rank lacked its twin): counted as a
        miss and a hydrate error instead, and its snapshot leaves L1 so it is not chosen again."""
        if self.l1 is not None:
            self.l1.discard(hit.snapshot)
        with self._lock:
            if hit.exact:
                self.stats.exact_hits -= 1
            else:
                self.stats.prefix_hits -= 1
            self.stats.prefill_tokens_saved -= hit.length
            self.stats.misses += 1
            self.stats.hydrate_errors += 1

    def release_pages(self, wanted, keep=()) -> int:
        """Drop L1 snapshots holding pages (least recently used first, none in `keep`) until `wanted()` is true."""
        return self.l1.release_pages(wanted, keep) if self.l1 is not None else 0

    def shared_prefix(self, prompt) -> Snapshot | None:
        """The L1 snapshot holding pages by reference that `restore` would hydrate into a slot
        of this session's pages (uncounted): the pages a request admitted for it need not get anew."""
        if self.l1 is None:
            return None
        data = token_bytes(prompt)
        n = len(data) // TOKEN_BYTES
        snap = self.l1.peek(self.codec.identity.key, data,
                            lambda s: self._usable(s.length) and (s.length < n or s.logits is not None))
        return snap if snap is not None and snap.pages is not None else None

    def _write_loop(self) -> None:
        while True:
            snap = self._queue.get()
            try:
                if snap is None:
                    return
                self.l2.put(snap)
            except Exception as exc:  # a failed write must not kill the writer; it is reported
                with self._lock:
                    self.last_write_error = repr(exc)
                    self.stats.l2_write_failures += 1
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued L2 write has finished."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Finish queued writes, stop the writer and release the L2 directory."""
        if self._thread is not None:
            self.flush()
            self._queue.put(None)
            self._thread.join()
            self._thread = self._queue = None
        if self.l2 is not None:
            self.l2.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- stats ----------------------------------------------------------------------------

    def stats_dict(self) -> dict:
        """Totals over both tiers plus each tier's own counters.

        hits + misses = lookups; evictions, bytes and errors add up the tiers; bytes_in and
        bytes_out are bytes written into and read out of L2.
        """
        with self._lock:
            out = self.stats.as_dict()
        l1 = self.l1.stats.as_dict() if self.l1 is not None else {}
        l2 = self.l2.stats.as_dict() if self.l2 is not None else {}
        out.update(
            evictions=l1.get("evictions", 0) + l2.get("evictions", 0),
            bytes_in=l2.get("bytes_in", 0),
            bytes_out=l2.get("bytes_out", 0),
            load_errors=l2.get("load_errors", 0) + out["hydrate_errors"],
            checksum_failures=l2.get("checksum_failures", 0),
            enabled=self.enabled,
        )
        if self.l1 is not None:
            out["l1"] = {**l1, "bytes": self.l1.nbytes, "entries": len(self.l1)}
        if self.l2 is not None:
            out["l2"] = {**l2, "bytes": self.l2.tracked_bytes(), "writable": self.l2.writable}
        return out
