"""The L2 directory's file names, and the file operations an L2 store makes in a directory it does
not trust: an open never follows a link nor waits on a FIFO and reads nothing but a regular file,
and a removal removes a link itself, never its target (l2.py says why).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from b12x_toolchain.runtime.prefix import snapshot_file
from b12x_toolchain.runtime.prefix.keys import KEY_PREFIX
from b12x_toolchain.runtime.prefix.snapshot import Snapshot

NAME = re.compile(r"^([0-9a-f]{16})-(\d{9})-([0-9a-f]{64})\.safetensors$")
TMP_PREFIX, TMP_SUFFIX = ".tmp-", ".partial"
LOCK, JOURNAL = ".lock", "recency.log"

# Opens that never follow a link at the last component and never wait on a FIFO.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotRegularFile(OSError):
    """A name in the directory is a link, FIFO, socket or directory: never opened through."""


def file_name(snap: Snapshot) -> str:
    return f"{snap.identity.key[:KEY_PREFIX]}-{snap.length:09d}-{snap.token_hash}.safetensors"


def open_regular(path: Path, flags: int, mode: int = 0o644) -> int:
    """An fd of the regular file at `path` itself, opened with `flags`; NotRegularFile for
    anything else (a link is refused, not followed; a FIFO's fd is closed unread)."""
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, mode)
    except OSError as exc:
        # ELOOP: a link (O_NOFOLLOW); EISDIR: a directory opened to write; ENXIO: a socket,
        # or a FIFO opened to write while nothing reads it.
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise NotRegularFile(exc.errno, f"{path}: a link, directory, socket or FIFO; "
                                            "expected a regular file") from None
        raise
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind != stat.S_IFREG:
            raise NotRegularFile(errno.EINVAL, f"{path}: file type {kind:#o}; "
                                               f"expected a regular file ({stat.S_IFREG:#o})")
        # O_NONBLOCK only guarded the open: reads and writes of a regular file go back to normal.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_new(path: Path):
    """A new file at `path`, opened for writing; fails if anything (a link included) is already there."""
    return os.fdopen(open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb")


def is_regular(entry: os.DirEntry) -> bool:
    """Whether the entry itself is a regular file (a link to one is not); nothing is opened."""
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:
        return False


def unlink(path: Path) -> bool:
    """Remove the name `path` (a link itself, never its target); whether it is gone.
    A directory, or a directory this store may not write, keeps it: never an exception."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_chunks(fileobj, chunks) -> None:
    for chunk in chunks:
        fileobj.write(chunk)


_POOL = None


def hash_pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="b12x-l2-hash")
    return _POOL


def _read_into(f, view: memoryview, start: int, end: int) -> int:
    done = start
    while done < end:
        n = f.readinto(view[done:end])
        if not n:
            break
        done += n
    return done - start


def read_file(path: Path) -> tuple[memoryview, bytes | None]:
    """The whole file in one uninitialised buffer (zero-filling it would cost a pass), and
    the digests of its data chunks when there are several: each is hashed on a pool thread
    as soon as it is read, so hashing overlaps reading."""
    chunk = snapshot_file.CHECKSUM_CHUNK
    with os.fdopen(open_regular(path, os.O_RDONLY), "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        view = memoryview(torch.empty(size, dtype=torch.uint8).numpy())
        done = _read_into(f, view, 0, min(size, 8))
        start = snapshot_file.data_start(view[:done], size)
        futures = []
        if start is not None and size - start > chunk:
            done += _read_into(f, view, done, start)
            while done < size:
                n = _read_into(f, view, done, min(size, done + chunk))
                if not n:
                    break
                futures.append(hash_pool().submit(snapshot_file.chunk_digest, view[done : done + n]))
                done += n
        else:
            done += _read_into(f, view, done, size)
    if done != size:
        raise snapshot_file.CorruptSnapshot(f"file shrank from {size} to {done} bytes while being read")
    return view, (b"".join(f.result() for f in futures) if futures else None)
