"""Padding rows write nothing a request owns, for every pass and rows bucket.

A replay of n rows pads its bucket with rows that name the scratch slot (the session's
last slot), no page (block-table entries -1) and a count of 0 (session.py: Bucket.padding).
Were a padding row to name slot 0 or page 0 instead (what a zero-filled static input
holds), it would overwrite the first request's ring rows, length or first page; were it
given a page, it would write garbage into a free page the next request is handed. So for
each package (the tiny recipe's, and the shipped dsv41-mini) and each pass and bucket, a
replay of fewer rows than the bucket must change only the replayed rows' slots and pages
and the scratch slot, and leave every free page as it was poisoned (0xFF). Verify and
draft write staging only: for them every persistent byte stays as it was.

test_session_by_kind checks the values a padding row's static inputs hold; this module
checks where a whole replay with padding rows writes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.package.reader import Package
from conftest import random_tokens

# About 14 s of its own on two busy cores; the two exports it needs are shared fixtures of the run.
pytestmark = [pytest.mark.exports, pytest.mark.slow(minutes=0.25), pytest.mark.usefixtures("one_torch_thread")]

PACKAGES = {"dsv41-tiny": "fused_path", "dsv41-mini": "shipped_path"}  # recipe name -> fixture of its export
BYSTANDERS = (0, 1)  # requests that are never replayed: slot 0 and page 0 are a zero-filled input's values
SENTINEL = 0x5A
SETUP_TOKENS = 5  # each request's prompt: one page of each pool, and a few rows of history


def _cases():
    """package, bucket, pass, rows: n = 1 and n = bucket - 1 for every bucket with padding
    rows (bucket 1 has none), the passes in the recipe's order (commit after verify)."""
    out = []
    for name in PACKAGES:
        passes = load_recipe(name).passes
        for bucket in sorted({b for p in type(passes).model_fields for b in getattr(passes, p).rows_buckets}):
            for pass_name in type(passes).model_fields:
                if bucket not in getattr(passes, pass_name).rows_buckets:
                    continue
                for rows in sorted({1, bucket - 1} & set(range(1, bucket))):
                    out.append(pytest.param(name, bucket, pass_name, rows,
                                            id=f"{name}-{pass_name}-bucket{bucket}-rows{rows}"))
    return out


def _one_bucket(package, bucket: int) -> Package:
    """The package with `bucket` as every pass's only rows bucket: a replay of n rows takes the
    smallest bucket that holds them, so only then do 1 and bucket - 1 rows both land in it."""
    passes = {name: dataclasses.replace(info, rows_buckets=[bucket]) for name, info in package.passes.items()}
    return Package(package.path, package.manifest, passes, package.weights)


@pytest.fixture(scope="module")
def prepared():
    """Loaded packages by recipe name, and the session of the (package, bucket) under test:
    each graph is deserialised once, and each session serves all its passes' cases."""
    return {"packages": {}, "session": None}


def _session(request, prepared: dict, name: str, bucket: int):
    """bucket + 1 request slots (the replayed rows, up to bucket - 1, and the two bystanders),
    each holding a prefilled prompt; the bystanders' bytes are overwritten with a sentinel,
    so that a padding write of zeros (what a zero-filled row computes) shows too."""
    if prepared["session"] is not None and prepared["session"][0] == (name, bucket):
        return prepared["session"][1]
    packages = prepared["packages"]
    if name not in packages:
        packages[name] = load(request.getfixturevalue(PACKAGES[name]))
    package = packages[name]
    assert all(bucket in info.rows_buckets for info in package.passes.values())
    session = _one_bucket(package, bucket).session(slots=bucket + 1)
    gen = torch.Generator().manual_seed(bucket)
    chunk = package.passes["prefill"].width
    slots = list(range(session.slots))
    for start in range(0, len(slots), bucket):
        group = slots[start : start + bucket]
        session.replay("prefill", token_ids=[random_tokens(gen, chunk, package.vocab_size) for _ in group],
                       slot_ids=group, positions=[0] * len(group), new_tokens=[SETUP_TOKENS] * len(group))
    for slot in BYSTANDERS:
        for view in _held_by(session, slot):
            view.view(torch.uint8).fill_(SENTINEL)
    prepared["session"] = ((name, bucket), session)  # one at a time: the cases come grouped by it
    return session


def _paged(session) -> dict[str, str]:
    """Paged cache name -> its pool."""
    return {name: pool for pool, caches in session.pages.caches.items() for name in caches}


def _held_by(session, slot: int) -> list[torch.Tensor]:
    """Views of every byte the request in `slot` holds: its row of each per-slot cache, and
    its pages of each paged cache."""
    paged = _paged(session)
    return [cache[page : page + 1] for name, cache in session.caches.items() if name in paged
            for page in session.pages.held[paged[name]][slot]] + \
           [cache[slot : slot + 1] for name, cache in session.caches.items() if name not in paged]


def _by_row(cache: torch.Tensor) -> torch.Tensor:
    """A cache's bytes, one row per slot (per-slot caches) or page (paged caches)."""
    return cache.view(torch.uint8).reshape(cache.shape[0], -1)


def _changed(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    return set((_by_row(before) != _by_row(after)).any(dim=1).nonzero().flatten().tolist())


def _values(session, pass_name: str, slots: list[int], gen: torch.Generator) -> dict:
    """A replay's inputs by kind. Counts are the pass's width, so a prefill chunk crosses
    page boundaries and the replayed rows are given new pages."""
    info = session.package.passes[pass_name]
    values = {"slot_ids": slots, "positions": [session.seq_lens[s] for s in slots]}
    if info.input_of("token_ids") is not None:
        values["token_ids"] = [random_tokens(gen, info.width, session.package.vocab_size) for _ in slots]
    if info.advances_kind is not None:
        values[info.advances_kind] = [info.width] * len(slots)
    return values


def _pages(session, slots) -> dict[str, set[int]]:
    """Per pool, the pages the requests in `slots` hold."""
    return {pool: {p for s in slots for p in session.pages.held[pool][s]} for pool in session.pages.pools}


def _misplaced_writes(session, before: dict, free: dict, held_before: dict, replayed: list[int]) -> dict:
    """What the replay changed where it must not, by rule and cache: slots (per-slot caches)
    or pages (paged caches). Empty when every write landed in the replayed rows' slots and
    pages or in the scratch slot."""
    others = [s for s in range(session.slots) if s not in replayed]
    paged = _paged(session)
    theirs, ours = _pages(session, others), _pages(session, replayed)
    given = {pool: ours[pool] - held_before[pool] for pool in ours}
    changed = {name: _changed(before[name], cache) for name, cache in session.caches.items()}
    scratch = session.scratch_slot
    found = {
        # (a) another request's row of a per-slot cache (window ring, compressor state, length...)
        "other slots' rows": {n: sorted(c & set(others)) for n, c in changed.items() if n not in paged},
        # (b) a page another request holds
        "other slots' pages": {n: sorted(c & theirs[paged[n]]) for n, c in changed.items() if n in paged},
        # (c) a free page, other than those the replay handed its rows, no longer holds its poison
        "free pages": {n: [p for p in sorted(set(free[paged[n]]) - given[paged[n]])
                           if not bool((_by_row(session.caches[n])[p] == 0xFF).all())] for n in paged},
        # (d) anything outside the replayed rows' slots and pages and the scratch slot; and the
        # scratch slot holds no page, or padding rows would have one to write
        "outside the replayed rows and the scratch slot": {
            n: sorted(c - (ours[paged[n]] if n in paged else {*replayed, scratch})) for n, c in changed.items()},
        "pages of the scratch slot": {
            pool: session.pages.held[pool][scratch] + [p for p in table[scratch].tolist() if p != -1]
            for pool, table in session.pages.tables.items()},
    }
    found = {rule: {k: v for k, v in where.items() if v} for rule, where in found.items()}
    return {rule: where for rule, where in found.items() if where}


@pytest.mark.parametrize("package,bucket,pass_name,rows", _cases())
def test_a_replay_with_padding_rows_writes_only_its_rows_and_the_scratch_slot(request, prepared, package, bucket,
                                                                             pass_name, rows):
    session = _session(request, prepared, package, bucket)
    assert session.bucket_for(pass_name, rows).rows == bucket > rows  # so bucket - rows padding rows run
    replayed = list(range(session.slots - rows, session.slots))  # the highest slots: the bystanders stay below
    others = [s for s in range(session.slots) if s not in replayed]
    session.poison_free_pages()
    free = session.pages.free_pages()
    held_before = _pages(session, replayed)
    held_by_others = [[list(session.pages.held[pool][s]) for pool in session.pages.pools] for s in others]
    before = {name: cache.clone() for name, cache in session.caches.items()}
    lengths = list(session.seq_lens)

    session.replay(pass_name, **_values(session, pass_name, replayed, torch.Generator().manual_seed(rows)))

    assert _misplaced_writes(session, before, free, held_before, replayed) == {}
    assert [[list(session.pages.held[pool][s]) for pool in session.pages.pools] for s in others] == held_by_others
    if session.package.passes[pass_name].advances is None:
        # Verify and draft write staging only: no persistent byte changes, the scratch slot's
        # included, no length moves and no page is handed out.
        assert [name for name, cache in session.caches.items() if not torch.equal(before[name], cache)] == []
        assert session.seq_lens == lengths and _pages(session, replayed) == held_before
