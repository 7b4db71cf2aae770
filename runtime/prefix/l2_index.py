"""An L2 store's index of its directory's snapshot files: what each file's name says and its size,
least recently used first, the bytes they add up to, and which ones a read in progress pins."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from b12x_toolchain.runtime.prefix.l2_files import NAME


@dataclass
class IndexEntry:
    key16: str
    length: int
    token_hash: str
    size: int
    pins: int = 0  # reads in progress: a pinned entry is never evicted


class L2Index:
    """Not locked by itself: the store calls it under its own lock."""

    def __init__(self):
        self.entries: OrderedDict[str, IndexEntry] = OrderedDict()  # least recently used first
        self.tracked = 0  # bytes of the entries' files

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.tracked = 0

    def add(self, name: str, size: int) -> None:
        m = NAME.match(name)
        self.entries[name] = IndexEntry(m.group(1), int(m.group(2)), m.group(3), size)
        self.tracked += size

    def drop(self, name: str) -> None:
        entry = self.entries.pop(name, None)
        if entry is not None:
            self.tracked -= entry.size

    def touch(self, name: str) -> None:
        """Make `name` the most recently used entry, if it is still one."""
        if name in self.entries:
            self.entries.move_to_end(name)

    def pin(self, name: str) -> bool:
        """Pin the entry `name` for a read; False when it is gone."""
        entry = self.entries.get(name)
        if entry is None:
            return False
        entry.pins += 1
        return True

    def unpin(self, name: str) -> None:
        entry = self.entries.get(name)
        if entry is not None:
            entry.pins -= 1

    def candidates(self, key16: str, max_length: int,
                   accept: Callable[[str, int], bool]) -> dict[int, list[tuple[str, str]]]:
        """(name, token hash) of the entries of the package `key16` that hold at most `max_length`
        tokens and that `accept(name, length)` takes, by their length."""
        found = {}
        for name, e in self.entries.items():
            if e.key16 == key16 and e.length <= max_length and accept(name, e.length):
                found.setdefault(e.length, []).append((name, e.token_hash))
        return found

    def victims(self, size: int, budget: int) -> list[str] | None:
        """The least recently used unpinned entries to evict so that `size` more bytes fit in
        `budget` (none when they fit already); None when pinned entries leave too little room."""
        victims, freed = [], 0
        for name, entry in self.entries.items():
            if self.tracked - freed + size <= budget:
                break
            if entry.pins == 0:
                victims.append(name)
                freed += entry.size
        return victims if self.tracked - freed + size <= budget else None
