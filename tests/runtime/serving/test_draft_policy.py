"""Speculation that pays or steps aside: greedy groups decode without drafting while their drafts
do not pay for the verify step, probe again later, and decode exactly the tokens they would
have; sampled groups always draft (their seeded tokens must not depend on timings)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from b12x_toolchain.runtime import EngineOptions, open_engine
from b12x_toolchain.runtime.serving import executor as executor_module
from b12x_toolchain.runtime.serving.draft_policy import DraftPolicy
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from conftest import random_tokens

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rows(n: int, temperature: float = 0.0) -> list:
    return [SimpleNamespace(temperature=temperature, speculation=None) for _ in range(n)]


def steps_of(policy: DraftPolicy, group: list, steps: int, tokens: int, verify_s=2.0, decode_s=1.0) -> str:
    """Run `steps` steps of `group` whose verify steps emit `tokens` a row: "d" drafted, "." decoded."""
    trace = ""
    for _ in range(steps):
        if policy.drafts(group):
            policy.drafted(group, [tokens] * len(group), verify_s)
            trace += "d"
        else:
            policy.decoded(group, decode_s)
            trace += "."
    return trace


def test_a_group_whose_drafts_never_pay_steps_aside_and_probes_ever_less_often():
    policy = DraftPolicy(lambda mode, n: n, first_probe=2, last_probe=8)
    trace = steps_of(policy, rows(2), 40, tokens=1)
    # The prior (2 tokens a step) decays below the unmeasured ratio (1.5) in three steps; then
    # probes after 2, 4, 8 and 8 decode steps (a verify step measured at twice a decode step).
    assert trace == "ddd" + ".." + "d" + "...." + "d" + "........" + "d" + "........" + "d" + "........" + "d" + ".."
    assert policy.ratio(2) == pytest.approx(2.0)
    assert policy.probes == 5


def test_a_probe_that_pays_puts_the_group_back_to_drafting():
    policy = DraftPolicy(lambda mode, n: n, first_probe=2, last_probe=8)
    group = rows(1)
    assert steps_of(policy, group, 8, tokens=1) == "ddd" + ".." + "d" + ".."
    # Aside for 2 more steps, then the probe pays: drafting every step from there on.
    assert steps_of(policy, group, 12, tokens=5) == ".." + "d" * 10
    assert policy.wait == 0 and policy.interval == 2


def test_drafts_that_pay_keep_every_step_drafting_and_a_new_request_earns_its_own_standing():
    policy = DraftPolicy(lambda mode, n: n)
    assert steps_of(policy, rows(4), 30, tokens=4) == "d" * 30
    never_right = DraftPolicy(lambda mode, n: n, first_probe=4)
    settled = rows(1)
    steps_of(never_right, settled, 12, tokens=1)  # a verify step costs two decode steps
    assert not never_right.drafts(settled)
    newcomer = rows(1)  # starts from the prior, 2 tokens a step: another prompt may suit the drafter
    assert never_right.drafts(newcomer)
    never_right.drafted(newcomer, [1], 2.0)
    assert not never_right.drafts(newcomer) and never_right.wait > 0  # aside with the engine until its next probe


def test_a_group_with_a_sampled_row_always_drafts():
    policy, group = DraftPolicy(lambda mode, n: n), rows(2)
    steps_of(policy, group, 12, tokens=1)
    assert not policy.drafts(group)
    assert policy.drafts(group[:1] + rows(1, temperature=0.8))


def test_a_buckets_first_step_is_not_timed():
    policy = DraftPolicy(lambda mode, n: n)
    policy.drafted(rows(1), [3], 100.0)  # first touch of the bucket's buffers
    policy.drafted(rows(1), [3], 2.0)
    policy.decoded(rows(1), 50.0)
    policy.decoded(rows(1), 1.0)
    assert policy.ratio(1) == pytest.approx(2.0)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [random_tokens(gen, 10 + 13 * i) for i in range(n)]


class PassClock:
    """The executor's clock, advanced only by the passes its session replays: a verify step (draft,
    verify, commit) costs two decode steps on any machine. On CPU cores shared with other work the
    toy passes' times sit too close together, and vary too much, for real timings to say whether
    drafting pays."""

    COSTS = {"prefill": 1.0, "draft": 0.5, "verify": 1.0, "commit": 0.5, "decode": 1.0}

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def timing(self, session):
        replay = session.replay

        def timed(name, **values):
            self.now += self.COSTS[name]
            return replay(name, **values)

        session.replay = timed
        return session


def _run(package, requests, clock: PassClock | None = None, **engine) -> tuple[list[list[int]], Engine]:
    session = package.session(slots=4)
    built = Engine(clock.timing(session) if clock else session, **engine)
    return [state.tokens for state in built.generate(requests)], built


def test_greedy_rows_step_aside_from_a_draft_pass_that_is_never_right_and_decode_the_same_tokens(small_pkg,
                                                                                                  monkeypatch):
    requests = [Request(p, 24) for p in _prompts(4)]
    greedy, _ = _run(small_pkg, requests, speculative=False)
    always, drafting = _run(small_pkg, requests)
    clock = PassClock()
    monkeypatch.setattr(executor_module, "time", clock)
    adaptive, engine = _run(small_pkg, requests, clock, adaptive=True)
    assert adaptive == always == greedy
    # The small recipe's random weights: its drafts are not the target's (4 of 616 accepted).
    assert drafting.stats.accepted <= 4
    assert engine.stats.aside_rows > engine.stats.rows // 2
    assert engine.stats.drafted < drafting.stats.drafted // 2
    assert engine.last_step is not None and "decode" in engine.passes


def test_drafts_that_are_always_right_are_never_set_aside(small_pkg):
    requests = [Request(p, 24) for p in _prompts(4)]
    greedy, _ = _run(small_pkg, requests, speculative=False)
    right = {tuple(r.prompt): tokens for r, tokens in zip(requests, greedy)}
    oracle = lambda group: [(right[tuple(r.prompt)][len(r.tokens):] + [1] * 7)[:7] for r in group]  # noqa: E731
    tokens, engine = _run(small_pkg, requests, adaptive=True, drafter=oracle)
    assert tokens == greedy
    assert engine.stats.aside_rows == 0 and engine.stats.accepted > engine.stats.rows * 3


def test_sampled_requests_always_draft_and_keep_their_seeded_tokens(small_pkg):
    requests = [Request(p, 16, temperature=0.8, seed=i) for i, p in enumerate(_prompts(3))]
    always, _ = _run(small_pkg, requests)
    adaptive, engine = _run(small_pkg, requests, adaptive=True)
    assert adaptive == always
    assert engine.stats.aside_rows == 0


def test_every_front_end_steps_aside_by_default(small_pkg):
    assert EngineOptions().adaptive
    assert open_engine(small_pkg, EngineOptions(slots=1)).executor.policy is not None
    assert open_engine(small_pkg, EngineOptions(slots=1, adaptive=False)).executor.policy is None
    assert open_engine(small_pkg, EngineOptions(slots=1, speculative=False)).executor.policy is None
