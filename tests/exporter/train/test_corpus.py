"""The corpus: the interpreter's standard library, split by path, the same on every load."""

from __future__ import annotations

import pytest

from b12x_toolchain.exporter.train.corpus import EXCLUDED_DIRS, SIZE_LIMIT, fingerprint, is_heldout, load_corpus


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_the_split_is_deterministic_and_disjoint(corpus):
    again = load_corpus()
    assert again == corpus and fingerprint(again) == fingerprint(corpus)
    assert not set(corpus.train_paths) & set(corpus.heldout_paths)
    assert list(corpus.train_paths) == sorted(corpus.train_paths)
    assert all(is_heldout(p) for p in corpus.heldout_paths) and not any(is_heldout(p) for p in corpus.train_paths)
    assert len(corpus.train) == len(corpus.train_paths) and len(corpus.heldout) == len(corpus.heldout_paths)


def test_about_a_tenth_is_held_out(corpus):
    share = len(corpus.heldout) / (len(corpus.train) + len(corpus.heldout))
    assert 0.06 < share < 0.14, share


def test_excluded_folders_and_files_are_left_out(corpus):
    paths = corpus.train_paths + corpus.heldout_paths
    assert not any(set(p.split("/")[:-1]) & EXCLUDED_DIRS for p in paths)
    assert all(p.endswith(".py") for p in paths)
    assert all(len(t.encode()) <= SIZE_LIMIT for t in corpus.train + corpus.heldout)


def test_a_corpus_of_a_folder(tmp_path):
    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("a = 1\n")
    (tmp_path / "pkg" / "tests" / "t.py").write_text("t = 1\n")
    (tmp_path / "latin1.py").write_bytes(b"x = '\xe9'\n")
    (tmp_path / "big.py").write_text("#" * (SIZE_LIMIT + 1))
    (tmp_path / "notes.txt").write_text("not Python")
    small = load_corpus(tmp_path)
    assert small.train_paths + small.heldout_paths == ("pkg/a.py",)
    changed = (tmp_path / "pkg" / "a.py").write_text("a = 2\n")
    assert changed and fingerprint(load_corpus(tmp_path)) != fingerprint(small)


def test_a_root_that_is_no_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="corpus root .*nothing: not a directory"):
        load_corpus(tmp_path / "nothing")
    with pytest.raises(ValueError, match="no training files"):
        load_corpus(tmp_path)
