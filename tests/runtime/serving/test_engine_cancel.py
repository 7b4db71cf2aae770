"""Engine.cancel: a cancelled request leaves at once, its slot and pages back before the next step."""

from __future__ import annotations

import pytest

from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_cancel_returns_slot_and_pages_and_the_others_go_on(small_pkg):
    engine = Engine(small_pkg.session(slots=1))
    running, waiting, alone = engine.submit([Request([1, 2, 3], 50, id="a"), Request([4, 5], 3, id="b"),
                                             Request([7, 8], 1, id="c")])
    engine.step()
    assert running.slot == 0 and running.tokens and not running.done and waiting.slot == -1
    in_use = lambda: sum(pool["in_use"] for pool in engine.session.pages.stats()["pools"].values())
    assert in_use() > 0
    assert engine.cancel("c") is alone and alone.finish_reason == "cancelled" and list(engine.waiting) == [waiting]
    assert engine.cancel("a") is running and running.finish_reason == "cancelled"
    assert engine.cancel("a") is None  # already gone
    assert list(engine.free) == [0] and not engine.active and in_use() == 0
    engine.run()
    assert waiting.finish_reason == "length" and len(waiting.tokens) == 3
    assert [s.id for s in engine.finished] == ["c", "a", "b"]
