"""The recency journal of an L2 directory, `recency.log` (l2.py says who writes it and when)."""

from __future__ import annotations

import os
import secrets
from collections import OrderedDict
from collections.abc import Callable, Collection
from pathlib import Path

from b12x_toolchain.runtime.prefix.l2_files import (
    JOURNAL,
    TMP_PREFIX,
    TMP_SUFFIX,
    NotRegularFile,
    create_new,
    open_regular,
    unlink,
)


class RecencyJournal:
    """One file name per line, in access order. `pos` is how many of its bytes the store has
    folded into its order, `lines` how many lines the store knows it to hold."""

    def __init__(self, directory: Path, count_not_regular: Callable[[str], None]):
        self.dir, self.path = directory, directory / JOURNAL
        # Told when something other than a regular file sits under the journal's name.
        self._count_not_regular = count_not_regular
        self.pos = 0
        self.lines = 0

    def order(self, found: Collection[str]) -> list[str]:
        """Names of `found` least recently used first: unmentioned ones first (by name),
        then by their last line in the journal."""
        last = {}
        data = self.read(0)
        self.pos = len(data)
        lines = data.split(b"\n")
        for i, line in enumerate(lines[:-1]):  # a torn last line is ignored
            name = line.decode("ascii", "replace")
            if name in found:
                last[name] = i
        self.lines = len(lines) - 1
        return sorted((n for n in found if n not in last)) + sorted(last, key=last.get)

    def read(self, start: int) -> bytes:
        """The journal from byte `start` on; empty when it is missing, unreadable or not a
        regular file (a link is not followed: recency is advice, and the writer's next
        compaction puts a real journal in the link's place)."""
        try:
            with os.fdopen(open_regular(self.path, os.O_RDONLY), "rb") as f:
                f.seek(start)
                return f.read()
        except NotRegularFile:
            self._count_not_regular(JOURNAL)
        except OSError:
            pass
        return b""

    def ingest(self, entries: OrderedDict) -> None:
        """Writer: fold in accesses appended since the last look (readers' hits), moving each
        entry they name to the most recently used end of `entries`."""
        data = self.read(self.pos)
        end = data.rfind(b"\n") + 1
        self.pos += end
        for line in data[:end].split(b"\n")[:-1]:
            name = line.decode("ascii", "replace")
            self.lines += 1
            if name in entries:
                entries.move_to_end(name)

    def append(self, name: str, create: bool) -> bool:
        """Record an access to `name` (creating the journal when `create`); whether the journal
        could be opened. A failed write is not an error: recency is advice."""
        try:
            fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0))
        except NotRegularFile:
            self._count_not_regular(JOURNAL)
            return False  # never append through a link: its target is not ours
        except OSError:
            return False  # a reader on a read-only directory just does not record it
        try:
            os.write(fd, name.encode() + b"\n")
        except OSError:
            pass
        finally:
            os.close(fd)
        self.lines += 1
        return True

    def compact(self, names: Collection[str]) -> bool:
        """Replace the journal by one line per name, in the order given; whether it was replaced.
        The new journal is written aside and renamed over the name (a link there, never its target)."""
        tmp = self.dir / f"{TMP_PREFIX}journal-{os.getpid()}-{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            with create_new(tmp) as f:
                f.write(b"".join(n.encode() + b"\n" for n in names))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError:
            unlink(tmp)
            return False
        self.pos = os.lstat(self.path).st_size
        self.lines = len(names)
        return True
