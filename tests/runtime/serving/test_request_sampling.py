"""Per-request temperature and top-p: a greedy request is untouched by a sampled neighbour, and a
sampled request's output is fixed by its seed whatever shares its batch."""

from __future__ import annotations

import pytest

from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = Request([3, 1, 4, 1, 5], 6, id="greedy")
SAMPLED = Request([2, 7, 1, 8], 6, id="sampled", seed=5, temperature=1.0, top_p=0.9)


def test_requests_sample_with_their_own_settings(small_pkg):
    session = small_pkg.session(slots=2)
    together = Engine(session).generate([GREEDY, SAMPLED])
    assert together[0].tokens == Engine(session).generate([GREEDY])[0].tokens
    assert together[1].tokens == Engine(session).generate([SAMPLED])[0].tokens
    assert (together[1].temperature, together[1].top_p, together[0].temperature) == (1.0, 0.9, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        Engine(session).submit([Request([1], 1, top_p=0.0)])
