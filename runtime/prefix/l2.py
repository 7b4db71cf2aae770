"""L2: a directory of snapshot files that survives restarts, under a byte budget.

Files: `<key16>-<length:09d>-<token sha256>.safetensors` (snapshot_file.py), so a lookup
filters by package and token hash from names alone and opens only real candidates, then
compares the tokens exactly. Next to them:

* `.lock` — the writer holds an exclusive flock on it for as long as it lives. One writer
  per directory; every other store on the directory (another process, or a second store
  in this one) is a reader: it never creates, renames or deletes snapshot files. A
  reader whose put finds the lock free becomes the writer (the old one has exited).
  A forked child shares its parent's lock: open stores after forking workers.
* `recency.log` — one file name per line, appended on every insert and hit, by the writer
  and (best effort) by readers. Line order is access order, so LRU order survives a
  restart and counts hits of every process; file mtimes would only give write order.
  The writer folds new lines in before it evicts and compacts the log now and then.
* `.tmp-*.partial` — a file being written. A write goes to such a file, is fsynced,
  renamed into place and the directory fsynced, so a crash leaves either the whole file
  or an orphaned temporary, never a partial snapshot under a real name.

A writer starting up removes orphaned temporaries, verifies every file (structure and
checksum; `scrub=False` defers that to the first read), removes what fails, and rebuilds
its byte accounting from what is on disk. A file that fails a later read (truncated,
flipped bit, bad header, gone between listing and reading) is a counted miss; the writer
removes it, a reader skips it. Entries being read are pinned and never evicted.

The directory's contents are not trusted to be what this module wrote. Only regular files
are ever opened: the listing looks at each entry itself (lstat, never a link's target),
and every open is O_NOFOLLOW | O_NONBLOCK and checked with fstat before a byte is read,
so a name swapped for a link or a FIFO after the listing is refused too (a FIFO opened
without O_NONBLOCK would block until someone writes to it). Under a snapshot's or the
journal's name, a link, FIFO or socket is counted (`not_regular`) and never used; the
writer's start-up removes it — the link itself, never its target. A linked lock file makes
the store a reader. Nothing outside the directory is read, written, renamed or removed.

This module holds the store; l2_files.py names and opens the files, l2_journal.py keeps the recency
log and l2_index.py the store's index of the snapshot files (recency order, sizes, pins).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from b12x_toolchain.runtime.package.kinds import TOKEN_BYTES
from b12x_toolchain.runtime.prefix import keys as prefix_keys
from b12x_toolchain.runtime.prefix import l2_files, snapshot_file
from b12x_toolchain.runtime.prefix.keys import KEY_PREFIX, Identity
from b12x_toolchain.runtime.prefix.l2_files import (
    JOURNAL,
    LOCK,
    NAME,
    TMP_PREFIX,
    TMP_SUFFIX,
    NotRegularFile,
    create_new,
    file_name,
    fsync_dir,
    hash_pool,
    is_regular,
    open_regular,
    unlink,
)
from b12x_toolchain.runtime.prefix.l2_index import L2Index
from b12x_toolchain.runtime.prefix.l2_journal import RecencyJournal
from b12x_toolchain.runtime.prefix.snapshot import Snapshot

# The store reads and writes snapshot files through these names of this module, so that either can
# be stood in for: a read held while its entry is pinned, a write stopped halfway (tests/runtime/prefix).
_read_file, _write_chunks = l2_files.read_file, l2_files.write_chunks
RESCAN_SECONDS = 1.0  # a reader lists the directory again at least this often


@dataclass
class L2Stats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    writes: int = 0
    write_errors: int = 0  # disk full, permissions: the snapshot is not stored
    write_skipped_read_only: int = 0  # another store is the directory's writer
    write_drops_pinned: int = 0  # no room without evicting entries being read
    too_large: int = 0  # larger than the whole budget: not stored
    evictions: int = 0
    bytes_in: int = 0  # bytes written into the tier
    bytes_out: int = 0  # bytes read out of it by hits
    load_errors: int = 0  # malformed, truncated or vanished files
    checksum_failures: int = 0
    schema_rejects: int = 0  # sound files of another snapshot schema
    identity_rejects: int = 0  # sound files of another package under a matching name prefix
    hash_collisions: int = 0
    orphans_removed: int = 0  # temporaries left by a writer that died mid-write
    files_removed: int = 0  # files removed because they failed verification
    not_regular: int = 0  # links, FIFOs, sockets, directories under our names: never opened through

    def as_dict(self) -> dict:
        return asdict(self)


class L2Store:
    def __init__(self, directory, max_bytes: int, scrub: bool = True):
        if max_bytes < 0:
            raise ValueError(f"L2 max_bytes must be >= 0, got {max_bytes}")
        self.dir, self.max_bytes, self.scrub = Path(directory), max_bytes, scrub
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = L2Stats()
        self._lock = threading.RLock()
        self._index = L2Index()
        self._bad: set[str] = set()  # a reader's files that failed verification: skipped, not removed
        self._not_regular: set[str] = set()  # names already counted in stats.not_regular
        self._journal = RecencyJournal(self.dir, self._count_not_regular)
        self._scanned_at, self._dir_mtime = 0.0, None
        self._lock_fd = self._open_lock()
        self.writable = False
        if not self._try_lock():
            self._scan()

    # -- ownership and start-up ---------------------------------------------------------

    def _open_lock(self) -> int | None:
        """The lock file's fd; None (the store only reads) when it cannot be had. A link
        there is not followed: locking its target would lock nothing the others lock."""
        try:
            return open_regular(self.dir / LOCK, os.O_RDWR | os.O_CREAT)
        except NotRegularFile:
            self._count_not_regular(LOCK)
            return None
        except OSError:
            try:  # a read-only directory: this store can only ever read
                return open_regular(self.dir / LOCK, os.O_RDONLY)
            except NotRegularFile:
                self._count_not_regular(LOCK)
                return None
            except OSError:
                return None

    def _count_not_regular(self, name: str) -> None:
        """Count a non-regular entry once while it stays (a reader lists it again and again)."""
        with self._lock:
            if name not in self._not_regular:
                self._not_regular.add(name)
                self.stats.not_regular += 1

    def _try_lock(self) -> bool:
        if self._lock_fd is None:
            return False
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by the writer, or a file system without flock: read only
            return False
        self.writable = True
        self._recover()
        return True

    def _recover(self) -> None:
        """Writer start-up: drop orphans and failing files, rebuild accounting and LRU order."""
        with self._lock:
            self._index.clear()
            self._remove_strays()
            found = {}
            for name, size in self._list().items():
                if self.scrub:
                    try:
                        snapshot_file.verify(*_read_file(self.dir / name), pool=hash_pool())
                    except (snapshot_file.CorruptSnapshot, snapshot_file.SchemaMismatch, OSError) as exc:
                        self._count_failure(exc, name)
                        self._remove_failed(name, exc)
                        continue
                found[name] = size
            order = self._journal.order(found)
            for name in order:
                self._index.add(name, found[name])
            self._compact_journal()
            if self._index.tracked > self.max_bytes:  # the budget shrank since the last run
                self._make_room(0)
            fsync_dir(self.dir)

    def _remove_strays(self) -> None:
        """Writer start-up: remove orphaned temporaries, and whatever sits under a snapshot's
        or the journal's name without being a regular file. unlink removes a link itself,
        never its target; a directory refuses it and stays, skipped by every listing."""
        for entry in os.scandir(self.dir):
            name = entry.name
            if name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX):
                unlink(Path(entry.path))
                self.stats.orphans_removed += 1
            elif (NAME.match(name) or name == JOURNAL) and not is_regular(entry):
                self._count_not_regular(name)
                if unlink(Path(entry.path)):
                    self._not_regular.discard(name)  # gone: a new one there is counted again

    def _list(self) -> dict[str, int]:
        """Snapshot files by name and size, from lstat: a link, FIFO or directory under a
        snapshot's name is counted and left out, so no lookup ever opens it."""
        out, strays = {}, set()
        for entry in os.scandir(self.dir):
            if NAME.match(entry.name):
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    out[entry.name] = info.st_size
                else:
                    strays.add(entry.name)
        with self._lock:  # names that went away (or became files) are counted again if they come back
            self._not_regular = {n for n in self._not_regular if n in strays or not NAME.match(n)}
        for name in strays:
            self._count_not_regular(name)
        return out

    def _scan(self, force: bool = False) -> bool:
        """A reader's view of the directory: which files exist, nothing verified yet.

        The directory's mtime says when to list it again, but it ticks coarsely (two renames
        can share one value), so a reader also lists again before it answers a miss.
        Returns whether the listing changed.
        """
        try:
            mtime = os.stat(self.dir).st_mtime_ns
        except FileNotFoundError:
            return False
        now = time.monotonic()
        if not force and mtime == self._dir_mtime and now - self._scanned_at < RESCAN_SECONDS:
            return False
        self._dir_mtime, self._scanned_at = mtime, now
        found = self._list()
        with self._lock:
            if found.keys() == self._index.entries.keys():
                return False
            self._bad &= set(found)
            for name in [n for n in self._index.entries if n not in found]:
                self._index.drop(name)
            for name in self._journal.order({n: s for n, s in found.items() if n not in self._index.entries}):
                self._index.add(name, found[name])
        return True

    # -- recency journal ----------------------------------------------------------------

    def _append_journal(self, name: str) -> None:
        """Record an access; the writer compacts the journal once it has grown well past its entries."""
        if self._journal.append(name, create=self.writable) and self.writable:
            if self._journal.lines > max(1024, 4 * len(self._index)):
                self._journal.ingest(self._index.entries)
                self._compact_journal()

    def _compact_journal(self) -> None:
        if self._journal.compact(self._index.entries):
            with self._lock:
                self._not_regular.discard(JOURNAL)  # a regular file there now: a later non-file is counted again

    # -- index --------------------------------------------------------------------------

    def tracked_bytes(self) -> int:
        return self._index.tracked

    def disk_bytes(self) -> int:
        """Bytes of the snapshot files on disk now (the journal and lock file are not counted)."""
        return sum(self._list().values())

    def names(self) -> list[str]:
        """Stored file names, least recently used first."""
        with self._lock:
            if self.writable:
                self._journal.ingest(self._index.entries)
            return list(self._index.entries)

    # -- lookup -------------------------------------------------------------------------

    def _count_failure(self, exc: Exception, name: str) -> None:
        if isinstance(exc, NotRegularFile):  # swapped in after the listing
            self._count_not_regular(name)
        elif isinstance(exc, snapshot_file.ChecksumMismatch):
            self.stats.checksum_failures += 1
        elif isinstance(exc, snapshot_file.SchemaMismatch):
            self.stats.schema_rejects += 1
        else:
            self.stats.load_errors += 1

    def _reject(self, name: str, exc: Exception) -> None:
        """A file failed to load: the writer removes it, a reader remembers to skip it."""
        with self._lock:
            self._count_failure(exc, name)
            if isinstance(exc, FileNotFoundError):
                self._index.drop(name)
            elif self.writable:
                if name in self._index:
                    self._index.drop(name)
                    self._remove_failed(name, exc)
            else:
                self._bad.add(name)

    def _remove_failed(self, name: str, exc: Exception) -> None:
        """Writer: remove a file that failed to load (a link itself, never its target)."""
        if not unlink(self.dir / name):
            return
        if isinstance(exc, NotRegularFile):  # not a damaged file: counted in not_regular already
            self._not_regular.discard(name)  # gone: a new one under the name is counted again
        else:
            self.stats.files_removed += 1

    def _load(self, name: str, identity: Identity) -> Snapshot | None:
        try:
            buf, digests = _read_file(self.dir / name)
            snap = snapshot_file.decode(buf, identity, digests, hash_pool())
        except snapshot_file.IdentityMismatch:
            with self._lock:
                self.stats.identity_rejects += 1
                self._bad.add(name)
            return None
        except (snapshot_file.CorruptSnapshot, snapshot_file.SchemaMismatch, OSError) as exc:
            self._reject(name, exc)
            return None
        with self._lock:
            self.stats.bytes_out += len(buf)
        return snap

    def lookup(self, identity: Identity, prompt: bytes,
               usable: Callable[[int], bool] = lambda n: True) -> Snapshot | None:
        """Longest stored snapshot of `identity` whose tokens start `prompt` (lengths `usable` accepts)."""
        if not self.writable:
            self._scan()
        snap = self._lookup(identity, prompt, usable)
        if snap is None and not self.writable and self._scan(force=True):
            snap = self._lookup(identity, prompt, usable)  # the writer added files since the last listing
        with self._lock:
            self.stats.lookups += 1
            if snap is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
        return snap

    def _lookup(self, identity: Identity, prompt: bytes, usable) -> Snapshot | None:
        key16 = identity.key[:KEY_PREFIX]
        with self._lock:
            candidates = self._index.candidates(key16, len(prompt) // TOKEN_BYTES,
                                                lambda name, length: name not in self._bad and usable(length))
        hashes = prefix_keys.prefix_hashes(identity.key, prompt, candidates) if candidates else {}
        for length in sorted(candidates, reverse=True):
            for name, hashed in candidates[length]:
                with self._lock:
                    if hashed != hashes[length] or not self._index.pin(name):
                        continue
                try:
                    snap = self._load(name, identity)
                finally:
                    with self._lock:
                        self._index.unpin(name)
                if snap is None:
                    continue
                if snap.tokens != prompt[: TOKEN_BYTES * length]:
                    with self._lock:
                        self.stats.hash_collisions += 1
                    continue
                with self._lock:
                    self._index.touch(name)
                self._append_journal(name)
                return snap
        return None

    # -- insert and evict ---------------------------------------------------------------

    def _make_room(self, size: int) -> bool:
        """Evict least recently used, unpinned entries until `size` more bytes fit."""
        self._journal.ingest(self._index.entries)
        victims = self._index.victims(size, self.max_bytes)
        if victims is None:
            return False
        for name in victims:
            self._index.drop(name)
            unlink(self.dir / name)
            self.stats.evictions += 1
        return True

    def put(self, snap: Snapshot) -> bool:
        """Store `snap` durably; False (counted) when it is not stored."""
        if not self.writable and not self._try_lock():
            with self._lock:
                self.stats.write_skipped_read_only += 1
            return False
        name = file_name(snap)
        with self._lock:
            if name in self._index:
                self._index.touch(name)
                self._append_journal(name)
                return True
        chunks, size = snapshot_file.encode(snap)
        if size > self.max_bytes:
            with self._lock:
                self.stats.too_large += 1
            return False
        tmp = self.dir / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}{TMP_SUFFIX}"
        try:
            with create_new(tmp) as f:
                _write_chunks(f, chunks)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            unlink(tmp)
            with self._lock:
                self.stats.write_errors += 1
            return False
        with self._lock:
            if name in self._index:  # another thread stored the same snapshot meanwhile
                unlink(tmp)
                return True
            if not self._make_room(size):
                unlink(tmp)
                self.stats.write_drops_pinned += 1
                return False
            try:
                os.replace(tmp, self.dir / name)
                fsync_dir(self.dir)
            except OSError:
                unlink(tmp)
                self.stats.write_errors += 1
                return False
            self._index.add(name, size)
            self.stats.writes += 1
            self.stats.bytes_in += size
            self._append_journal(name)
        return True

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the writer lock
            self._lock_fd = None
            self.writable = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
