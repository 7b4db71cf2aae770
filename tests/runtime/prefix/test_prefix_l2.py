"""L2: durable writes, true LRU that survives restarts, damage is a counted miss, one writer."""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import pytest

from b12x_toolchain.runtime.prefix import l2 as prefix_l2
from b12x_toolchain.runtime.prefix import snapshot_file
from b12x_toolchain.runtime.prefix.keys import token_bytes
from b12x_toolchain.runtime.prefix.l2 import L2Store, file_name
from runtime.prefix.helpers import fake_identity, is_intact, make_snapshot, same

IDENT = fake_identity()


def snap_of(i: int, length: int = 12, row_bytes: int = 64):
    return make_snapshot(IDENT, [i] * length, row_bytes=row_bytes)


def size_of(snap) -> int:
    return snapshot_file.encode(snap)[1]


def lookup(store, tokens, ident=IDENT):
    return store.lookup(ident, token_bytes(tokens))


def consistent(store) -> bool:
    """Tracked bytes equal the bytes on disk, and no temporary is left behind."""
    leftovers = [p for p in os.listdir(store.dir) if p.startswith(prefix_l2.TMP_PREFIX)]
    return store.tracked_bytes() == store.disk_bytes() and leftovers == []


def test_put_lookup_and_survive_a_restart(tmp_path):
    snaps = [snap_of(i) for i in range(3)]
    with L2Store(tmp_path, 1 << 20) as store:
        assert store.writable
        assert all(store.put(s) for s in snaps)
        assert store.put(snaps[0])  # the same snapshot again: nothing rewritten
        assert store.stats.writes == 3 and consistent(store)
    with L2Store(tmp_path, 1 << 20) as store:
        for i, snap in enumerate(snaps):
            got = lookup(store, [i] * 12 + [7, 7])
            assert got is not None and same(got, snap)
        assert lookup(store, [5] * 12) is None
        s = store.stats
        assert (s.lookups, s.hits, s.misses) == (4, 3, 1) and s.bytes_out == 3 * size_of(snaps[0])
        assert consistent(store)


def test_longest_prefix_and_exact_tokens_behind_the_name(tmp_path):
    with L2Store(tmp_path, 1 << 20) as store:
        short, long = make_snapshot(IDENT, [1, 2, 3]), make_snapshot(IDENT, [1, 2, 3, 4, 5])
        store.put(short)
        store.put(long)
        assert lookup(store, [1, 2, 3, 4, 5, 6]).length == 5
        assert lookup(store, [1, 2, 3, 4, 9]).length == 3
        assert store.lookup(IDENT, token_bytes([1, 2, 3, 4, 5]), lambda n: n < 5).length == 3
        assert lookup(store, [1, 2, 3], fake_identity("b")) is None  # another package's name prefix
        assert len(store.names()) == 2  # ...which is not a reason to remove anything


def _budget(count: int) -> int:
    return count * size_of(snap_of(0)) + size_of(snap_of(0)) // 2


def test_eviction_is_true_lru_persisted_across_restarts_not_mtime(tmp_path):
    with L2Store(tmp_path, _budget(3)) as store:
        for i in range(3):
            store.put(snap_of(i))
        assert lookup(store, [0] * 12) is not None  # 0 is now the most recently used
    # mtimes say 0 is the newest file and 1 the oldest... reverse them: LRU must not care.
    for age, i in enumerate((0, 1, 2)):
        os.utime(tmp_path / file_name(snap_of(i)), (1000 + age, 1000 + age))
    with L2Store(tmp_path, _budget(3)) as store:
        store.put(snap_of(3))
        assert lookup(store, [1] * 12) is None and store.stats.evictions == 1
        assert all(lookup(store, [i] * 12) is not None for i in (0, 2, 3))
        assert consistent(store)


def test_hits_of_a_reader_count_for_the_writers_lru(tmp_path):
    writer = L2Store(tmp_path, _budget(3))
    reader = L2Store(tmp_path, _budget(3))  # the lock is taken: a second store only reads
    try:
        assert writer.writable and not reader.writable
        for i in range(3):
            writer.put(snap_of(i))
        assert lookup(reader, [0] * 12) is not None
        writer.put(snap_of(3))
        assert [n for n in writer.names()] == [file_name(snap_of(i)) for i in (2, 0, 3)]
    finally:
        reader.close()
        writer.close()


def test_an_entry_larger_than_the_budget_is_not_stored(tmp_path):
    with L2Store(tmp_path, _budget(2)) as store:
        store.put(snap_of(0))
        assert not store.put(snap_of(1, row_bytes=4096))
        assert store.stats.too_large == 1 and store.stats.evictions == 0
        assert len(store.names()) == 1 and consistent(store)


def test_a_reader_in_progress_keeps_its_entry(tmp_path, monkeypatch):
    store = L2Store(tmp_path, _budget(3))
    for i in range(3):
        store.put(snap_of(i))
    reading, release = threading.Event(), threading.Event()
    read = prefix_l2._read_file

    def slow_read(path):
        if path.name == file_name(snap_of(0)):
            reading.set()
            release.wait(10)
        return read(path)

    monkeypatch.setattr(prefix_l2, "_read_file", slow_read)
    result = []
    reader = threading.Thread(target=lambda: result.append(lookup(store, [0] * 12)))
    reader.start()
    assert reading.wait(10)
    store.put(snap_of(3))  # 0 is the least recently used, but pinned: 1 goes instead
    store.put(snap_of(4))
    assert (tmp_path / file_name(snap_of(0))).exists()
    assert not (tmp_path / file_name(snap_of(1))).exists() and not (tmp_path / file_name(snap_of(2))).exists()
    release.set()
    reader.join()
    assert result[0] is not None and is_intact(result[0])
    store.close()

    store = L2Store(tmp_path, _budget(1))  # a restart with a smaller budget keeps the most recent
    assert [n for n in store.names()] == [file_name(snap_of(0))] and store.stats.evictions == 2
    reading.clear()
    release.clear()
    reader = threading.Thread(target=lambda: result.append(lookup(store, [0] * 12)))
    reader.start()
    assert reading.wait(10)
    assert not store.put(snap_of(5))  # the only entry is being read: no room, the write is dropped
    assert store.stats.write_drops_pinned == 1
    release.set()
    reader.join()
    assert is_intact(result[1]) and consistent(store)
    store.close()


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped bit":
        data[-5] ^= 0x10
        path.write_bytes(data)
    elif how == "bad header":
        data[8:24] = b"not json at all!"
        path.write_bytes(data)
    elif how == "removed":
        path.unlink()


@pytest.mark.parametrize("how", ["truncated", "flipped bit", "bad header", "removed"])
def test_damage_found_at_read_is_a_counted_miss_and_the_file_goes(tmp_path, how):
    with L2Store(tmp_path, 1 << 20) as store:
        store.put(snap_of(0))
        store.put(snap_of(1))
        _damage(tmp_path / file_name(snap_of(0)), how)
        assert lookup(store, [0] * 12) is None  # never an exception, never wrong bytes
        s = store.stats
        assert s.misses == 1 and s.load_errors + s.checksum_failures == 1
        assert s.checksum_failures == (how == "flipped bit")
        assert not (tmp_path / file_name(snap_of(0))).exists() and file_name(snap_of(0)) not in store.names()
        assert is_intact(lookup(store, [1] * 12)) and consistent(store)


def test_start_up_removes_orphans_and_failing_files_and_rebuilds_accounting(tmp_path, monkeypatch):
    with L2Store(tmp_path, 1 << 20) as store:
        for i in range(4):
            store.put(snap_of(i))
    _damage(tmp_path / file_name(snap_of(0)), "flipped bit")
    _damage(tmp_path / file_name(snap_of(1)), "truncated")
    (tmp_path / f"{prefix_l2.TMP_PREFIX}123-abc{prefix_l2.TMP_SUFFIX}").write_bytes(b"half a snapshot")
    monkeypatch.setattr(snapshot_file, "SNAPSHOT_SCHEMA", 0)
    stale = make_snapshot(IDENT, [8] * 12)
    (tmp_path / file_name(stale)).write_bytes(b"".join(bytes(c) for c in snapshot_file.encode(stale)[0]))
    monkeypatch.undo()
    (tmp_path / "notes.txt").write_text("not ours: left alone")
    with L2Store(tmp_path, 1 << 20) as store:
        s = store.stats
        assert (s.orphans_removed, s.checksum_failures, s.schema_rejects, s.files_removed) == (1, 1, 1, 3)
        assert s.load_errors == 1  # the truncated one
        assert sorted(store.names()) == sorted(file_name(snap_of(i)) for i in (2, 3))
        assert store.tracked_bytes() == 2 * size_of(snap_of(2)) and consistent(store)
        assert (tmp_path / "notes.txt").exists()


def test_without_scrub_a_stale_schema_is_removed_at_first_read(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_file, "SNAPSHOT_SCHEMA", 0)
    with L2Store(tmp_path, 1 << 20) as store:
        store.put(snap_of(0))
    monkeypatch.undo()
    with L2Store(tmp_path, 1 << 20, scrub=False) as store:
        assert len(store.names()) == 1
        assert lookup(store, [0] * 12) is None
        assert store.stats.schema_rejects == 1 and store.names() == [] and consistent(store)


def test_a_write_is_fsynced_then_renamed_then_the_directory_fsynced(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def record_replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        replace(src, dst)

    store = L2Store(tmp_path, 1 << 20)
    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    store.put(snap_of(0))
    monkeypatch.undo()
    store.close()
    final = str(tmp_path / file_name(snap_of(0)))
    rename = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == final)
    tmp = events[rename][1]
    assert ("fsync", tmp) in events[:rename] and ("fsync", str(tmp_path)) in events[rename + 1 :]


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def full(fileobj, chunks):
        fileobj.write(bytes(chunks[0]))
        raise OSError(errno.ENOSPC, "No space left on device")

    with L2Store(tmp_path, 1 << 20) as store:
        monkeypatch.setattr(prefix_l2, "_write_chunks", full)
        assert not store.put(snap_of(0))
        assert store.stats.write_errors == 1 and store.names() == [] and consistent(store)


def test_one_writer_and_a_reader_takes_over_when_it_leaves(tmp_path):
    writer = L2Store(tmp_path, 1 << 20)
    reader = L2Store(tmp_path, 1 << 20)
    writer.put(snap_of(0))
    assert not reader.put(snap_of(1)) and reader.stats.write_skipped_read_only == 1
    assert is_intact(lookup(reader, [0] * 12))  # a reader sees what the writer stored
    (tmp_path / f"{prefix_l2.TMP_PREFIX}9-dead{prefix_l2.TMP_SUFFIX}").write_bytes(b"x")
    writer.close()
    assert reader.put(snap_of(1)) and reader.writable  # the lock was free: now it writes
    assert reader.stats.orphans_removed == 1 and consistent(reader)
    assert sorted(reader.names()) == sorted(file_name(snap_of(i)) for i in (0, 1))
    reader.close()


def test_threads_lose_nothing_and_corrupt_nothing(tmp_path):
    pool = [snap_of(i, length=10 + i % 5) for i in range(30)]
    store = L2Store(tmp_path, 10 * size_of(pool[0]))
    bad, stop = [], time.monotonic() + 60

    def work(seed):
        rng = random.Random(seed)
        for _ in range(60):
            if time.monotonic() > stop:
                return
            snap = pool[rng.randrange(len(pool))]
            if rng.random() < 0.4:
                store.put(snap)
            else:
                got = lookup(store, snap.token_ids + [3])
                if got is not None and not (is_intact(got) and got.tokens == snap.tokens):
                    bad.append(got)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = store.stats
    assert bad == [] and s.hits > 0 and s.evictions > 0
    assert s.hits + s.misses == s.lookups
    assert s.writes - s.evictions - s.files_removed == len(store.names())
    assert consistent(store) and store.tracked_bytes() <= store.max_bytes
    store.close()
    with L2Store(tmp_path, 1 << 20) as again:  # a full scrub finds every file sound
        assert again.stats.checksum_failures + again.stats.load_errors == 0 and len(again.names()) == len(store.names())


def test_large_snapshots_are_read_and_checked_chunk_by_chunk(tmp_path):
    big = snap_of(0, row_bytes=700_000)  # ~9.8 MB: three 4 MiB checksum chunks, hashed while reading
    with L2Store(tmp_path, 64 << 20) as store:
        store.put(big)
        assert is_intact(lookup(store, [0] * 12), row_bytes=700_000)
        path = tmp_path / file_name(big)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x04  # inside the second chunk
        path.write_bytes(data)
        assert lookup(store, [0] * 12) is None and store.stats.checksum_failures == 1
        store.put(big)
    path.write_bytes(data)
    with L2Store(tmp_path, 64 << 20) as store:  # the start-up scrub hashes chunks on the pool too
        assert store.stats.checksum_failures == 1 and store.names() == [] and consistent(store)
