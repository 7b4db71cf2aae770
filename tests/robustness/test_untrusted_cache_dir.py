"""An L2 prefix-cache directory edited by someone else: links, FIFOs, directories and
lenient JSON under the names the store uses.

Whatever sits there, the store never reads, writes, renames or removes anything outside
the directory, never opens anything but a regular file (opening a FIFO would block), and
meets every oddity with a counted miss, never an exception. Opens are watched with an
audit hook ("open" covers builtins.open and os.open), so "never opened" is observed, not
inferred from the results. Snapshots are synthetic (tests/runtime/prefix/helpers.py): no
package is exported, and the whole module runs in seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from b12x_toolchain.runtime.errors import SnapshotError
from b12x_toolchain.runtime.prefix import l2 as prefix_l2
from b12x_toolchain.runtime.prefix import snapshot_file
from b12x_toolchain.runtime.prefix.keys import Identity, token_bytes
from b12x_toolchain.runtime.prefix.l2 import L2Store, file_name
from runtime.prefix.helpers import fake_identity, is_intact, make_snapshot

IDENT = fake_identity()
TOKENS = [5] * 12
BUDGET = 1 << 20
WAIT_SECONDS = 20  # far beyond what a store needs here; only a blocked open gets near it


def wanted():
    """The snapshot every lookup below asks for, and the file name it looks under."""
    snap = make_snapshot(IDENT, TOKENS)
    return snap, file_name(snap)


def file_bytes(snap) -> bytes:
    return b"".join(bytes(c) for c in snapshot_file.encode(snap)[0])


def lookup(store):
    return store.lookup(IDENT, token_bytes(TOKENS + [9]))


@pytest.fixture
def dirs(tmp_path):
    """(the L2 directory, a folder outside it) in a sandbox of their own."""
    l2, outside = tmp_path / "l2", tmp_path / "outside"
    l2.mkdir()
    outside.mkdir()
    return l2, outside


def fingerprint(path: Path) -> tuple:
    """Contents and modification time: what any read-write access through a link would change."""
    return path.read_bytes(), path.stat().st_mtime_ns


# -- watching opens ---------------------------------------------------------------------

_recording: list | None = None  # the opens seen while opens_recorded() is active
_hooked = False


def reached(path: str, flags: int) -> str:
    """The file an open of `path` with `flags` reaches: with O_NOFOLLOW a link at the last
    component is not followed (the open fails on it instead)."""
    if flags & os.O_NOFOLLOW:
        return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    return os.path.realpath(path)


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _recording is not None:
        path, _mode, flags = args
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.fsdecode(path)
            # Resolved now: the store may remove the link right after reading through it.
            _recording.append((path, reached(path, flags or 0)))


@contextmanager
def opens_recorded():
    """(path, file it reached) for every open in this process meanwhile. An audit hook cannot
    be removed, so one is installed once and does nothing outside these blocks."""
    global _recording, _hooked
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True
    _recording = record = []
    try:
        yield record
    finally:
        _recording = None


def opened_outside(record, l2: Path) -> list[str]:
    """Files of the test's sandbox outside the L2 directory that any open reached (the
    interpreter's own files elsewhere are no concern here)."""
    sandbox, directory = os.path.realpath(l2.parent), os.path.realpath(l2)
    targets = [target for _, target in record]
    # The directory itself counts as inside: a writer opens it to fsync it.
    return [t for t in targets
            if os.path.commonpath([t, sandbox]) == sandbox and os.path.commonpath([t, directory]) != directory]


def test_the_open_watch_sees_an_open_through_a_link(dirs):
    # The checks below are only as good as this detector: opens that follow a link out are caught.
    l2, outside = dirs
    target = outside / "elsewhere"
    target.write_bytes(b"x")
    (l2 / "link").symlink_to(target)
    with opens_recorded() as record:
        (l2 / "link").read_bytes()
        os.close(os.open(l2 / "link", os.O_RDONLY))
    assert opened_outside(record, l2) == [os.path.realpath(target)] * 2


# -- not blocking -----------------------------------------------------------------------

def finishes(work, fifos: list[Path]):
    """`work()`'s result, failing (not hanging) if it blocks: a store that opened one of
    `fifos` waits for a writer, so the guard opens them for writing to let it go."""
    result = {}

    def run():
        try:
            result["value"] = work()
        except BaseException as exc:  # re-raised on the test's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_SECONDS)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the blocked reader sees EOF
            except OSError:
                pass
        thread.join(WAIT_SECONDS)
        pytest.fail(f"the store blocked for {WAIT_SECONDS}s: it opened a FIFO")
    if "error" in result:
        raise result["error"]
    return result["value"]


# -- the stores under test --------------------------------------------------------------

STORES = ["writer, scrub at start-up", "writer, checked at first read", "reader"]


@contextmanager
def open_store(l2: Path, which: str, plant=lambda: None):
    """A store of kind `which` on `l2`, with `plant()` run on the directory before it starts.
    A reader is a second store while a writer holds the lock: it never removes anything."""
    holder = L2Store(l2, BUDGET) if which == "reader" else None
    try:
        plant()
        store = L2Store(l2, BUDGET, scrub=which != "writer, checked at first read")
        assert store.writable == (which != "reader")
        try:
            yield store
        finally:
            store.close()
    finally:
        if holder is not None:
            holder.close()


# -- (a) a link to a sound snapshot outside ---------------------------------------------

@pytest.mark.parametrize("which", STORES)
def test_a_link_to_a_sound_snapshot_outside_is_not_a_hit(dirs, which):
    l2, outside = dirs
    snap, name = wanted()
    target = outside / name
    target.write_bytes(file_bytes(snap))  # exactly the file the lookup wants, but not in the directory
    before = fingerprint(target)
    with open_store(l2, which, lambda: (l2 / name).symlink_to(target)) as store:
        if store.writable:  # the start-up scrub removed the link itself
            assert not os.path.lexists(l2 / name)
        assert lookup(store) is None  # the slot is never filled from the outside file
        s = store.stats
        assert (s.lookups, s.hits, s.misses, s.not_regular, s.bytes_out) == (1, 0, 1, 1, 0)
        assert store.names() == []
    assert fingerprint(target) == before
    if which == "reader":  # a reader leaves the link; the next writer's start-up removes it
        assert (l2 / name).is_symlink()
        with L2Store(l2, BUDGET) as store:
            assert not os.path.lexists(l2 / name) and store.stats.not_regular == 1
        assert fingerprint(target) == before


def test_a_stored_file_swapped_for_a_link_after_the_listing_is_not_followed(dirs):
    # The listing saw a regular file; the open itself must refuse what is there now.
    l2, outside = dirs
    snap, name = wanted()
    with L2Store(l2, BUDGET) as store:
        assert store.put(snap)
        target = outside / name
        os.replace(l2 / name, target)
        (l2 / name).symlink_to(target)
        before = fingerprint(target)
        with opens_recorded() as record:
            assert lookup(store) is None
        assert opened_outside(record, l2) == []
        s = store.stats
        assert (s.hits, s.misses, s.not_regular, s.files_removed) == (0, 1, 1, 0)
        assert not os.path.lexists(l2 / name) and store.names() == []  # the link went, not its target
    assert fingerprint(target) == before


# -- (b) a link to an unrelated file outside --------------------------------------------

@pytest.mark.parametrize("which", STORES)
def test_a_link_to_an_unrelated_outside_file_is_never_opened(dirs, which):
    l2, outside = dirs
    _, name = wanted()
    target = outside / "private.key"
    target.write_bytes(b"someone else's file, not a snapshot\n")
    before = fingerprint(target)
    with opens_recorded() as record:  # around start-up (the scrub) and the lookups
        with open_store(l2, which, lambda: (l2 / name).symlink_to(target)) as store:
            found = [lookup(store), lookup(store)]
            stats = store.stats.as_dict()
    assert opened_outside(record, l2) == []
    assert fingerprint(target) == before
    assert found == [None, None] and (stats["lookups"], stats["misses"]) == (2, 2)
    assert stats["not_regular"] == 1
    assert stats["load_errors"] == stats["files_removed"] == 0  # skipped unread, not read and found damaged
    assert os.path.lexists(l2 / name) == (which == "reader")


# -- (c) FIFOs and directories under the store's names ----------------------------------

@pytest.mark.parametrize("which", STORES)
@pytest.mark.parametrize("where", ["snapshot", "journal"])
def test_a_fifo_is_skipped_and_counted_without_blocking(dirs, which, where):
    l2, _ = dirs
    snap, name = wanted()
    if where == "journal":  # a sound snapshot to hit, so the hit's journal append is tried too
        with L2Store(l2, BUDGET) as store:
            store.put(snap)
    fifo = l2 / (name if where == "snapshot" else prefix_l2.JOURNAL)

    def plant():
        if where == "journal":
            fifo.unlink()
        os.mkfifo(fifo)

    def start_and_look_up():
        with open_store(l2, which, plant) as store:
            found = lookup(store)
            return found, store.stats.as_dict()

    found, stats = finishes(start_and_look_up, [fifo])
    if where == "snapshot":
        assert found is None and stats["misses"] == 1
    else:
        assert found is not None and is_intact(found) and stats["hits"] == 1
    assert stats["not_regular"] == 1 and stats["load_errors"] == 0
    if which == "reader":
        assert fifo.is_fifo()  # a reader removes nothing
    elif where == "snapshot":
        assert not os.path.lexists(fifo)
    else:  # the writer's start-up put a real journal in its place
        assert fifo.is_file() and not fifo.is_symlink()


def test_a_stored_file_swapped_for_a_fifo_after_the_listing_is_not_read(dirs):
    l2, _ = dirs
    snap, name = wanted()
    store = L2Store(l2, BUDGET)
    try:
        assert store.put(snap)
        (l2 / name).unlink()
        os.mkfifo(l2 / name)
        assert finishes(lambda: lookup(store), [l2 / name]) is None
        s = store.stats
        assert (s.misses, s.not_regular, s.load_errors) == (1, 1, 0)
        assert not os.path.lexists(l2 / name)
    finally:
        store.close()


@pytest.mark.parametrize("which", STORES)
def test_a_directory_under_a_snapshot_name_is_skipped_without_an_exception(dirs, which):
    l2, _ = dirs
    _, name = wanted()
    with opens_recorded() as record:
        with open_store(l2, which, lambda: (l2 / name / "inside").mkdir(parents=True)) as store:
            assert lookup(store) is None
            assert store.names() == [] and store.disk_bytes() == 0
            stats = store.stats.as_dict()
    assert str(l2 / name) not in [path for path, _ in record]  # listed as a directory: never opened
    assert (stats["misses"], stats["not_regular"], stats["load_errors"]) == (1, 1, 0)
    assert (l2 / name / "inside").is_dir()  # not ours to empty


# -- (d) lenient JSON inside a snapshot file --------------------------------------------

def _field(checksum: str) -> bytes:
    return f'"{snapshot_file.CHECKSUM_KEY}":"{checksum}"'.encode()


def reseal(data: bytes, edit_header=lambda text: text, edit_record=lambda text: text) -> bytes:
    """`data` with its header text and/or snapshot record edited, and the checksum made
    right again the way the writer computes it: a sha256 anyone can recompute, so only the
    JSON checks stand between the edit and a hit."""
    size = struct.unpack_from("<Q", data)[0]
    header, payload = json.loads(data[8 : 8 + size]), data[8 + size :]
    meta = header["__metadata__"]
    meta[snapshot_file.META_KEY] = edit_record(meta[snapshot_file.META_KEY])
    zeros = "0" * 64
    meta[snapshot_file.CHECKSUM_KEY] = zeros
    text = edit_header(json.dumps(header, separators=(",", ":")).encode())
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text))
    digests = snapshot_file.chunk_digests(payload)
    checksum = hashlib.sha256(prefix + text + digests).hexdigest()
    return prefix + text.replace(_field(zeros), _field(checksum), 1) + payload


def _record(old: str, new: str):
    def edit(text: str) -> str:
        assert text.count(old) == 1, f"{old!r} is not once in the record {text[:120]!r}"
        return text.replace(old, new)
    return {"edit_record": edit}


def _header(old: bytes, new: bytes):
    def edit(text: bytes) -> bytes:
        assert text.count(old) == 1, f"{old!r} is not once in the header {text[:120]!r}"
        return text.replace(old, new)
    return {"edit_header": edit}


# Each edit keeps a lenient parser's reading the sound snapshot's (it keeps the last of
# two keys and accepts NaN where nothing reads it), so before strict JSON each was a hit.
LENIENT_JSON = {
    "record: duplicated key": _record('"length":12', '"length":999,"length":12'),
    "record: NaN": _record('{"caches":', '{"calibration":NaN,"caches":'),
    "record: Infinity": _record('{"caches":', '{"calibration":-Infinity,"caches":'),
    "header: duplicated __metadata__": _header(b'{"__metadata__":', b'{"__metadata__":{},"__metadata__":'),
    "header: duplicated tensor field": _header(b'"tokens":{"dtype":"I32"', b'"tokens":{"dtype":"F32","dtype":"I32"'),
    "header: NaN in the metadata": _header(b'{"__metadata__":{', b'{"__metadata__":{"note":NaN,'),
}


def test_the_resealed_files_are_otherwise_sound():
    # The edits below are caught by the JSON checks alone: unedited, a resealed file decodes.
    snap, _ = wanted()
    assert is_intact(snapshot_file.decode(bytearray(reseal(file_bytes(snap))), IDENT))


@pytest.mark.parametrize("edit", LENIENT_JSON)
def test_lenient_json_in_a_snapshot_is_a_damaged_file(edit):
    snap, _ = wanted()
    with pytest.raises(snapshot_file.CorruptSnapshot, match="strict JSON") as caught:
        snapshot_file.decode(bytearray(reseal(file_bytes(snap), **LENIENT_JSON[edit])), IDENT)
    assert not isinstance(caught.value, snapshot_file.ChecksumMismatch)


@pytest.mark.parametrize("which", STORES)
@pytest.mark.parametrize("edit", LENIENT_JSON)
def test_lenient_json_in_the_directory_is_a_counted_miss_and_removed(dirs, which, edit):
    l2, _ = dirs
    snap, name = wanted()
    data = reseal(file_bytes(snap), **LENIENT_JSON[edit])
    with open_store(l2, which, lambda: (l2 / name).write_bytes(data)) as store:
        if which == "writer, scrub at start-up":
            assert store.stats.files_removed == 1 and not (l2 / name).exists()
        assert lookup(store) is None  # never an exception
        s = store.stats
        assert (s.lookups, s.hits, s.misses) == (1, 0, 1)
        assert (s.load_errors, s.checksum_failures) == (1, 0)
        assert (l2 / name).exists() == (which == "reader")  # a writer removes it, a reader skips it
        assert s.files_removed == (which != "reader")


def test_identity_fields_must_be_strict_json():
    assert Identity.of({"schema": 1, "scale": 0.5}).fields == {"schema": 1, "scale": 0.5}
    for fields in ({"schema": 1, "scale": float("nan")}, {"schema": 1, "scale": float("inf")}):
        with pytest.raises(SnapshotError, match="plain JSON"):
            Identity.of(fields)


# -- (e) the journal and the lock file --------------------------------------------------

def test_a_linked_journal_is_not_read_and_the_writer_replaces_the_link(dirs):
    l2, outside = dirs
    snaps = [make_snapshot(IDENT, [i] * 12) for i in range(2)]
    with L2Store(l2, BUDGET) as store:
        for snap in snaps:
            store.put(snap)
    journal, target = l2 / prefix_l2.JOURNAL, outside / "journal-elsewhere"
    target.write_bytes(b"".join(file_name(s).encode() + b"\n" for s in reversed(snaps)))  # a wrong order
    before = fingerprint(target)
    journal.unlink()
    journal.symlink_to(target)
    with opens_recorded() as record:
        with L2Store(l2, BUDGET) as store:
            names = store.names()
            assert is_intact(store.lookup(IDENT, token_bytes([0] * 12)))
            stats = store.stats.as_dict()
    assert opened_outside(record, l2) == []
    assert fingerprint(target) == before
    assert names == sorted(file_name(s) for s in snaps)  # unmentioned in any journal: by name
    assert journal.is_file() and not journal.is_symlink()  # compacted into the link's place
    assert stats["not_regular"] == 1


def test_a_reader_never_appends_through_a_linked_journal(dirs):
    l2, outside = dirs
    snap, _ = wanted()
    target = outside / "journal-elsewhere"
    target.write_bytes(b"")
    before = fingerprint(target)
    with L2Store(l2, BUDGET) as writer:
        writer.put(snap)
        journal = l2 / prefix_l2.JOURNAL
        journal.unlink()
        journal.symlink_to(target)
        with opens_recorded() as record:
            with L2Store(l2, BUDGET) as reader:
                assert not reader.writable
                assert is_intact(lookup(reader))  # a hit: its recency would be appended
                stats = reader.stats.as_dict()
        assert opened_outside(record, l2) == []
        assert journal.is_symlink()
    assert fingerprint(target) == before
    assert stats["not_regular"] == 1


@pytest.mark.parametrize("target_exists", [True, False], ids=["to a file", "dangling"])
def test_a_linked_lock_is_not_followed_and_the_store_only_reads(dirs, target_exists):
    l2, outside = dirs
    snap, _ = wanted()
    with L2Store(l2, BUDGET) as store:  # a sound file to read
        store.put(snap)
    lock, target = l2 / prefix_l2.LOCK, outside / "lock-elsewhere"
    lock.unlink()
    if target_exists:
        target.write_bytes(b"not a lock of this directory\n")
        before = fingerprint(target)
    lock.symlink_to(target)
    with opens_recorded() as record:
        with L2Store(l2, BUDGET) as store:
            # Locking a link's target would lock something no other store on the directory locks.
            assert not store.writable and store.stats.not_regular == 1
            assert is_intact(lookup(store))
            assert not store.put(make_snapshot(IDENT, [6] * 12))
            assert store.stats.write_skipped_read_only == 1
    assert opened_outside(record, l2) == []
    assert lock.is_symlink()
    if target_exists:
        assert fingerprint(target) == before
    else:
        assert not os.path.lexists(target)  # O_CREAT through the link would have made it
