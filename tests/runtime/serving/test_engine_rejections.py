"""Bad requests, slots and slot ids are refused with clear errors before any replay."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from b12x_toolchain.runtime.session.validate import InputError


class CountingSession:
    """A session whose replays are counted, to show a refusal came before any of them."""

    def __init__(self, session):
        self.inner, self.replays = session, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def replay(self, pass_name, **values):
        self.replays.append(pass_name)
        return self.inner.replay(pass_name, **values)


def snapshot(session) -> dict:
    return {k: v.clone() for k, v in {**session.caches, **session.staging}.items()}


def unchanged(session, before: dict) -> bool:
    return all(torch.equal(before[k], v) for k, v in {**session.caches, **session.staging}.items())


@pytest.fixture
def counted(small_pkg):
    return CountingSession(small_pkg.session(slots=2))


GOOD = Request([1, 2, 3], 4)


@pytest.mark.parametrize("bad, message", [
    (Request([]), r"request 1: prompt is empty; at least one token is needed"),
    (Request([7] * 1024), r"request 1: prompt of 1024 tokens is longer than the model's limit of 1023 prompt tokens"),
    (Request([7] * 1000, 30), r"request 1: prompt of 1000 tokens plus max_new_tokens 30 exceeds the model's "
                              r"max_seq_len 1024; at most 24 new tokens fit"),
    (Request([1, 512]), r"request 1: prompt tokens: value 512 is out of range \(index 1\); expected a token id in \[0, 512\)"),
    (Request("1 2 3"), r"request 1: prompt must be a list of integer token ids"),
    (Request([1], 0), r"request 1: max_new_tokens must be an integer of at least 1, got 0"),
    (Request([1], stop=[-1]), r"request 1: stop token -1 is out of range"),
    (Request([1], seed=1.5), r"request 1: seed must be an integer"),
    (Request([1], id=0), r"request 0: id is used twice"),
])
def test_bad_requests_are_refused_before_any_replay(counted, bad, message):
    engine = Engine(counted)
    with pytest.raises(ValueError, match=message):
        engine.submit([GOOD, bad])  # the good request is not queued either
    assert not engine.busy and counted.replays == []


def test_request_ids_stay_unique_across_submissions(counted):
    engine = Engine(counted)
    engine.submit([Request([1], 2, id="a")])
    with pytest.raises(ValueError, match=r"request 'a': id is used twice"):
        engine.submit([Request([2], 2, id="a")])
    assert len(engine.waiting) == 1


@pytest.mark.parametrize("slots, message", [
    ([0, 5], r"slot 5 is out of range; the session has slots \[0, 2\)"),
    ([-1], r"slot -1 is out of range"),
    ([1, 0, 1], r"slot id 1 appears twice in \[1, 0, 1\]; each row needs its own slot"),
    ([2], r"slot 2 is the session's scratch slot, which padding rows use; requests get slots in \[0, 2\)"),
    ([], r"slots is empty"),
])
def test_bad_engine_slots_are_refused(counted, slots, message):
    with pytest.raises(ValueError, match=message):
        Engine(counted, slots=slots)
    assert counted.replays == []


def test_an_engine_uses_only_its_own_slots(small_pkg):
    session = small_pkg.session(slots=3)
    states = Engine(session, slots=[2]).generate([Request([1, 2], 3), Request([3], 2)])
    assert [s.slot for s in states] == [2, 2]
    assert session.seq_lens[:2] == [0, 0]


def test_a_drafter_with_the_wrong_count_is_refused_before_verify(counted):
    engine = Engine(counted, drafter=lambda rows: [[1] * 6 for _ in rows])
    engine.submit([GOOD])
    with pytest.raises(ValueError, match=r"drafter: request 0: expected 7 token ids in \[0, 512\), got \[1, 1, 1, 1, 1, 1\]"):
        engine.step()
    assert counted.replays == ["prefill"]


@pytest.mark.parametrize("pass_name", ["prefill", "verify", "draft"])
@pytest.mark.parametrize("row_ids, message", [
    ([0, 2], r"slot_ids: value 2 is out of range; expected a slot in \[0, 2\)"),  # 2 is the scratch slot
    ([-1], r"slot_ids: value -1 is out of range"),
    ([1, 1], r"slot_ids: \[1, 1\] repeats a slot; each row needs its own slot"),
])
def test_bad_row_ids_are_refused_before_any_write(small_pkg, pass_name, row_ids, message):
    session = small_pkg.session(slots=2)
    width = session.package.passes[pass_name].width
    values = dict(token_ids=[[1] * width] * len(row_ids), slot_ids=row_ids, positions=[0] * len(row_ids))
    if pass_name == "prefill":
        values["new_tokens"] = [1] * len(row_ids)
    before = snapshot(session)
    with pytest.raises(InputError, match=message):
        session.replay(pass_name, **values)
    assert unchanged(session, before)
