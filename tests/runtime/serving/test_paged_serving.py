"""Paged caches serve exactly like the contiguous layout, whatever pages requests get.

The contiguous layout: slot s's entries in pages s * pages_per_slot onwards, in order —
each slot's entries one run of memory, byte for byte the per-slot caches of format 2
([slots, max_seq_len / ratio, record]). Against it, a pool far smaller than every slot at
max_seq_len would need, so requests wait for pages, pages change hands between requests
in every order, and every free page is poisoned before each step.
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.errors import PagesExhausted
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from conftest import random_tokens

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow(minutes=0.3)]

REQUESTS, SLOTS = 32, 8  # four requests a slot: every slot changes hands, in every order
TIGHT_PAGES = 24  # per pool: about three requests' worth of the longest prompts, for 8 slots


@pytest.fixture(scope="module")
def requests():
    gen = torch.Generator().manual_seed(64)
    lengths = [1, 129, 200, 250] + torch.randint(1, 220, (REQUESTS - 4,), generator=gen).tolist()
    return [Request(random_tokens(gen, n), int(torch.randint(1, 13, (1,), generator=gen)), id=i, seed=i)
            for i, n in enumerate(lengths)]


def serve(package, requests, temperature, poison_free_pages=False, **pages):
    session = package.session(slots=SLOTS, max_rows=SLOTS, **pages)
    engine = Engine(session, temperature=temperature)
    engine.submit(requests)
    peak = 0
    while engine.busy:
        if poison_free_pages:
            session.poison_free_pages()
        engine.step()
        peak = max(peak, max(p["in_use"] for p in session.pages.stats()["pools"].values()))
        if session.pages.contiguous:  # every slot's pages are its own run, in order
            for pool, held in session.pages.held.items():
                width = session.pools[pool].pages_per_slot
                assert all(ids == list(range(s * width, s * width + len(ids))) for s, ids in enumerate(held))
    states = sorted(engine.finished, key=lambda s: s.id)
    return [s.tokens for s in states], engine.stats.as_dict(), peak, session


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_paged_serving_is_token_identical_to_the_contiguous_layout(small_pkg, requests, temperature):
    contiguous, base_stats, _, _ = serve(small_pkg, requests, temperature, contiguous=True)
    paged, stats, peak, session = serve(small_pkg, requests, temperature, poison_free_pages=True, pages=TIGHT_PAGES)
    assert paged == contiguous
    assert stats["page_waits"] > 0  # the pool was tight: requests waited for pages
    assert stats["slot_reuse"] == base_stats["slot_reuse"] == REQUESTS - SLOTS
    assert peak <= TIGHT_PAGES
    pools = session.pages.stats()["pools"]
    assert all(p["in_use"] == 0 and p["reserved"] == 0 for p in pools.values())  # every page came back


def test_a_request_that_can_never_fit_is_refused_before_anything_runs(small_pkg):
    session = small_pkg.session(slots=2, pages=4)  # 4 pages of 32 index-key tokens: 128 tokens at most
    engine = Engine(session)
    ok = Request(list(range(1, 60)), 4, id="fits")
    with pytest.raises(ValueError, match=r"request 'too long' can never fit this session: .* pages of pool "
                                         r"index_key_pages \(32 tokens each\); the session has 4"):
        engine.submit([ok, Request(list(range(1, 200)), 8, id="too long")])
    assert not engine.waiting and engine.stats.admitted == 0
    assert all(p["in_use"] == 0 for p in session.pages.stats()["pools"].values())
    assert engine.generate([ok])[0].done


def test_a_replay_without_pages_raises_before_writing(small_pkg):
    session = small_pkg.session(slots=2, pages=2)
    before = {n: t.clone() for n, t in session.caches.items()}
    with pytest.raises(PagesExhausted, match=r"pass prefill: 4 more pages of pool index_key_pages are needed"):
        session.replay("prefill", token_ids=[[1] * 64] * 2, slot_ids=[0, 1], positions=[0, 0], new_tokens=[64, 64])
    assert all(torch.equal(before[n], t) for n, t in session.caches.items())
