"""The training corpus: the `.py` sources of the running interpreter's standard library.

They are on every machine that runs Python, so training needs no download. The corpus is
deterministic for one interpreter: files in sorted relative-path order, the test suites,
IDLE, lib2to3, installed packages and turtledemo left out, and so is every file that is
not UTF-8 or is over SIZE_LIMIT bytes (generated tables, not code people write). A file
is held out when the sha1 of its relative POSIX path, as an integer, is divisible by 10:
the split depends on the path alone, so adding a file never moves another.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo"})
SIZE_LIMIT = 200_000  # bytes
HELDOUT_MODULUS = 10


@dataclass(frozen=True)
class Corpus:
    train: tuple[str, ...]  # file contents, in the order of train_paths
    heldout: tuple[str, ...]
    train_paths: tuple[str, ...]  # relative POSIX paths under the corpus root
    heldout_paths: tuple[str, ...]
    python_version: str  # the interpreter whose standard library this is


def is_heldout(relative_path: str) -> bool:
    return int(hashlib.sha1(relative_path.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def source_paths(root: Path) -> list[str]:
    """Relative POSIX paths of the `.py` files under `root`, sorted, excluded folders left out."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        base = Path(folder).relative_to(root)
        found += [(base / name).as_posix() for name in files if name.endswith(".py")]
    return sorted(found)


def _read_source(path: Path) -> str | None:
    """The file's text, or None when it is over the size limit or not UTF-8."""
    if not path.is_file() or path.stat().st_size > SIZE_LIMIT:
        return None
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def load_corpus(root: Path | None = None) -> Corpus:
    """The corpus of `root` (default: this interpreter's standard library directory)."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not root.is_dir():
        raise ValueError(f"corpus root {root}: not a directory; expected a folder of Python sources")
    split: dict[bool, list[tuple[str, str]]] = {False: [], True: []}
    for relative in source_paths(root):
        text = _read_source(root / relative)
        if text is not None:
            split[is_heldout(relative)].append((relative, text))
    if not split[False]:
        raise ValueError(f"corpus root {root}: no training files (.py, UTF-8, at most {SIZE_LIMIT} bytes)")
    train, heldout = split[False], split[True]
    return Corpus(tuple(t for _, t in train), tuple(t for _, t in heldout), tuple(p for p, _ in train),
                  tuple(p for p, _ in heldout), platform.python_version())


def fingerprint(corpus: Corpus) -> str:
    """sha256 over every file's path and contents, both splits, each length-prefixed: two
    corpora with this fingerprint train the same model from the same seed."""
    digest = hashlib.sha256()
    for paths, texts in ((corpus.train_paths, corpus.train), (corpus.heldout_paths, corpus.heldout)):
        for path, text in zip(paths, texts):
            for part in (path.encode(), text.encode()):
                digest.update(len(part).to_bytes(8, "little"))
                digest.update(part)
        digest.update(b"\0split")
    return digest.hexdigest()
