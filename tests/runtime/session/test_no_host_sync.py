"""A replay never waits for the device: every pass and rows bucket of the tiny package and of
the shipped model replays with every sync-like tensor call made to raise (host_sync.py), and
an engine step makes one device-to-host transfer."""

from __future__ import annotations

import random

import pytest
import torch

from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from host_sync import HostSync, no_host_sync


def _values(session, info, rows: int, gen: random.Random) -> dict:
    """Valid host values for `rows` rows of a pass, continuing each slot's committed length."""
    slots = list(range(rows))
    values = {"slot_ids": slots, "positions": [session.seq_lens[s] for s in slots]}
    kinds = {s.info.kind for s in info.inputs if s.role == "input"}
    if "token_ids" in kinds:
        vocab = session.package.manifest.model.vocab_size
        values["token_ids"] = [[gen.randrange(vocab) for _ in range(info.width)] for _ in range(rows)]
    if info.advances_kind is not None:
        values[info.advances_kind] = [1] * rows
    return values


def _replay_every_bucket(package) -> int:
    buckets = sorted({b for p in package.passes.values() for b in p.rows_buckets})
    session = package.session(slots=buckets[-1])
    gen = random.Random(0)
    # Each bucket full, and one row short where that still lands in it (its padding rows go up too).
    cases = [(name, n) for name in ("prefill", *[p for p in package.passes if p != "prefill"])
             for low, rows in zip([0, *package.passes[name].rows_buckets], package.passes[name].rows_buckets)
             for n in sorted({rows, max(rows - 1, low + 1)})]
    prepared = [_values(session, package.passes[name], rows, gen) for name, rows in cases[:1]]
    session.replay(cases[0][0], **prepared[0])  # history to read: every slot's first tokens
    with no_host_sync() as guard:
        for name, rows in cases:
            session.replay(name, **_values(session, package.passes[name], rows, gen))
    assert guard.replays == len(cases)
    assert any(session.bucket_for(name, n).rows > n for name, n in cases)  # padding rows were replayed
    return len(cases)


def test_every_pass_and_bucket_of_the_tiny_package_replays_without_a_host_sync(fused_pkg):
    assert _replay_every_bucket(fused_pkg) >= len(fused_pkg.passes)


def test_every_pass_and_bucket_of_the_shipped_model_replays_without_a_host_sync(shipped_path):
    package = load(shipped_path)
    assert _replay_every_bucket(package) >= len(package.passes)


def test_the_guard_catches_a_sync_like_call():
    tensor = torch.ones(2)
    for call in (lambda: tensor.item(), lambda: tensor.tolist(), lambda: bool(tensor[0]), lambda: int(tensor[0]),
                 lambda: float(tensor[0]), lambda: tensor.cpu(), lambda: tensor.nonzero(), lambda: torch.nonzero(tensor)):
        with no_host_sync(), pytest.raises(HostSync):
            call()
    assert tensor.tolist() == [1.0, 1.0]  # restored on leaving


def _steps(engine: Engine, requests: list[Request], allow=()) -> list[tuple[dict, int]]:
    """Run to completion; per step, its report and the transfers it made."""
    engine.submit(requests)
    out = []
    while engine.busy:
        with no_host_sync(allow) as guard:
            step = engine.step()
        out.append((step, guard.downloads))
    return out


@pytest.mark.parametrize("speculative", [True, False], ids=["speculative", "plain"])
def test_a_greedy_engine_step_makes_one_transfer(fused_pkg, speculative):
    session = fused_pkg.session(slots=2)
    engine = Engine(session, speculative=speculative)
    steps = _steps(engine, [Request(list(range(1, 40)), max_new_tokens=20), Request([7, 8, 9], max_new_tokens=20)])
    decoding = [downloads for step, downloads in steps if step.admitted == 0 and step.rows]
    assert decoding and all(downloads == 1 for downloads in decoding), steps
    # A step that admits prefills first: the new rows' first tokens are one more transfer.
    assert all(downloads <= 1 + (step.admitted > 0) for step, downloads in steps)


def test_a_sampled_speculative_step_makes_one_transfer(fused_pkg):
    """Sampled rows draw their drafts on the device and are accepted on the host from the
    one transfer: only sampling.py's draws over the downloaded distributions read tensors."""
    session = fused_pkg.session(slots=2)
    engine = Engine(session, speculative=True, temperature=0.8, seed=3)
    steps = _steps(engine, [Request([3, 4, 5, 6], max_new_tokens=16), Request([9] * 20, max_new_tokens=16)],
                   allow=("sampling.py",))
    decoding = [downloads for step, downloads in steps if step.admitted == 0 and step.rows]
    assert decoding and all(downloads == 1 for downloads in decoding), steps
