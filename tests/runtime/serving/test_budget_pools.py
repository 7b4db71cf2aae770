"""An engine on a session whose default pools come from a memory budget smaller than every slot
at max_seq_len: requests wait for pages and come out token-identical to the contiguous layout."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from b12x_toolchain.runtime.session import session as session_module
from conftest import random_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SLOTS, FRACTION = 8, 0.5


@pytest.fixture(scope="module")
def requests():
    gen = torch.Generator().manual_seed(16)
    lengths = [250, 200, 129] + torch.randint(1, 160, (13,), generator=gen).tolist()
    return [Request(random_tokens(gen, n), int(torch.randint(1, 9, (1,), generator=gen)), id=i)
            for i, n in enumerate(lengths)]


def serve(session, requests):
    engine = Engine(session)
    states = engine.generate(requests)
    assert all(p["in_use"] == 0 and p["reserved"] == 0 for p in session.pages.stats()["pools"].values())
    return [s.tokens for s in states], engine.stats.as_dict()


def test_budget_pools_serve_like_the_contiguous_layout(small_pkg, requests, monkeypatch):
    contiguous, _ = serve(small_pkg.session(slots=SLOTS, max_rows=SLOTS, contiguous=True), requests)
    probe = small_pkg.session(slots=SLOTS, max_rows=SLOTS)  # its budget holds every slot: the other bytes
    one = sum(p.pages_per_slot * p.page_bytes for p in probe.pools.values())
    free = (probe.memory_budget["other_bytes"] + one * 5 // 4) / FRACTION  # one and a quarter max-length requests
    monkeypatch.setattr(session_module, "free_bytes", lambda device: int(free))
    session = small_pkg.session(slots=SLOTS, max_rows=SLOTS, memory_fraction=FRACTION)
    assert all(p.pages_per_slot < p.count < SLOTS * p.pages_per_slot // 4 for p in session.pools.values())
    limit = small_pkg.manifest.model.max_seq_len  # a max-length request is admitted, not refused
    assert session.pages.never_fits(limit) is None and session.pages.can_reserve(0, 0, limit)
    tokens, stats = serve(session, requests)
    assert tokens == contiguous
    assert stats["page_waits"] > 0  # the budget was tight: requests waited for pages
    assert stats["admitted"] == stats["retired"] == len(requests)
