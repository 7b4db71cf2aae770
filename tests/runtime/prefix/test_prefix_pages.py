"""Prefix hits share pages by reference: nothing of the prefix's entries is copied.

A 3,900-token prefix (60 full 64-token entry pages and a partly filled one; 121 full
32-token index-key pages and a partly filled one) is prefilled into slot 0 of the small
recipe at max_seq_len 64k and stored in L1. Slots 1 and 2 hydrate it: their block tables
point at the very pages the snapshot holds, and no page is copied. Then every slot goes
on with a tail: slot 1 like slot 0 (bitwise the same logits), slot 2 with another tail,
whose writes must not show in slot 1 (they copy the shared partial page first).
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.prefix.cache import PrefixCache
from conftest import random_tokens

# No slow mark: scheduled after the modules that build the 64k export, it never waits for it.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PREFIX, CHUNK = 3_900, 64


@pytest.fixture(scope="module")
def long_pkg(long_path):  # the very export test_context_independence uses
    return load(long_path)


def prefill(session, slot: int, tokens: list[int], start: int = 0) -> torch.Tensor:
    """Prefill tokens[start:] into `slot` chunk by chunk; the last position's logits."""
    for at in range(start, len(tokens), CHUNK):
        piece = tokens[at : at + CHUNK]
        out = session.replay("prefill", token_ids=[piece + [0] * (CHUNK - len(piece))], slot_ids=[slot],
                             positions=[at], new_tokens=[len(piece)])
        logits = out["logits"][0, len(piece) - 1].clone()
    return logits


def held(session, slot: int) -> dict[str, list[int]]:
    return {pool: list(ids) for pool, ids in ((p, session.pages.held[p][slot]) for p in session.pages.pools)}


def test_a_hit_shares_the_prefix_pages_and_continues_bitwise(long_pkg):
    gen = torch.Generator().manual_seed(39)
    prefix, tail, other = (random_tokens(gen, n) for n in (PREFIX, 64, 64))
    session = long_pkg.session(slots=3, pages=300)
    cache = PrefixCache(long_pkg, l1_bytes=1 << 30)
    logits = prefill(session, 0, prefix)
    snapshot = cache.store(session, 0, prefix, logits)
    assert session.pages.snapshot_copies == 2  # the partly filled last page of each pool

    copied_before = {p: pool.copied for p, pool in session.pages.pools.items()}
    for slot in (1, 2):
        hit = cache.restore(session, slot, prefix + tail)
        assert hit is not None and hit.length == PREFIX and hit.tier == "l1"
        assert held(session, slot) == {p: list(ids) for p, ids in snapshot.pages.ids.items()}
    assert session.pages.hydrate_copies == 0
    assert {p: pool.copied for p, pool in session.pages.pools.items()} == copied_before
    full = {p: PREFIX // pool.tokens_per_page for p, pool in session.pages.pools.items()}
    for pool, ids in held(session, 1).items():  # full pages are slot 0's own, held by 4 now
        assert ids[: full[pool]] == held(session, 0)[pool][: full[pool]]
        assert all(session.pages.pools[pool].refs[page] == 4 for page in ids[: full[pool]])

    cache.l1.clear()  # eviction drops the snapshot's references, never the slots'
    assert snapshot.pages.released
    source = prefill(session, 0, prefix + tail, start=PREFIX)
    session.poison_free_pages()
    isolated = prefill(session, 2, prefix + other, start=PREFIX)  # writes first: copies the partial pages
    session.poison_free_pages()
    hydrated = prefill(session, 1, prefix + tail, start=PREFIX)
    assert torch.equal(hydrated, source)
    assert not torch.equal(isolated, source)
    for pool, ids in held(session, 2).items():
        assert ids[full[pool]] not in held(session, 1)[pool]  # each slot wrote its own copy
