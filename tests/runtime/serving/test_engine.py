"""The serving loop: many requests over reused slots decode exactly as each would alone."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from b12x_toolchain.runtime.serving.speculative import Decoder
from conftest import poison, random_tokens
from same_tokens import assert_same_tokens

REQUESTS, SLOTS = 32, 8  # each slot serves four requests in turn
COUNTERS = ("rows", "padding_rows", "drafted", "accepted", "bonus", "prefill_tokens", "admitted", "retired",
            "slot_reuse", "generated")

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow(minutes=0.4)]


def greedy_alone(package, prompt, max_new_tokens):
    """Plain greedy decoding of one prompt in a fresh session (sessions cost milliseconds on CPU)."""
    decoder = Decoder(package.session(slots=1, max_rows=1))
    return decoder.generate([prompt], max_new_tokens, speculative=False)[0], decoder.margins[0]


@pytest.fixture(scope="module")
def workload(small_pkg):
    """32 requests with their greedy references; every fourth stops at a token its reference emits."""
    gen = torch.Generator().manual_seed(64)
    lengths = [1, 1, 129, 200] + torch.randint(1, 220, (REQUESTS - 4,), generator=gen).tolist()
    requests, expected, margins = [], [], []
    for i, length in enumerate(lengths):
        prompt = random_tokens(gen, length)
        max_new = int(torch.randint(1, 13, (1,), generator=gen))
        want, gaps = greedy_alone(small_pkg, prompt, max_new)
        stop = ()
        if i % 4 == 3:
            stop = (want[int(torch.randint(0, len(want), (1,), generator=gen))],)
            want = want[: want.index(stop[0]) + 1]
        requests.append(Request(prompt, max_new, stop, id=i))
        expected.append(want)
        margins.append(gaps)
    assert any(len(r.prompt) > 128 for r in requests) and any(len(r.prompt) == 1 for r in requests)
    return requests, expected, margins


def oracle_drafter(expected, seed=5):
    """Right for a random number (0..7) of tokens per row and step, so verify accepts 0..7 drafts."""
    gen = torch.Generator().manual_seed(seed)

    def drafter(rows):
        out = []
        for row in rows:
            done, right = len(row.tokens), int(torch.randint(0, 8, (1,), generator=gen))
            truth = expected[row.id][done : done + 7]
            guess = truth[:right] + [(t + 1) % 512 for t in truth[right:]]
            out.append((guess + [1] * 7)[:7])
        return out

    return drafter


@pytest.mark.parametrize("drafting", ["oracle", "draft pass"])
def test_32_requests_through_8_slots_decode_as_greedy_alone(small_pkg, workload, drafting):
    requests, expected, margins = workload
    session = small_pkg.session(slots=SLOTS, max_rows=SLOTS)
    assert {p: sorted(b) for p, b in session.buckets.items()} == {p: [1, 2, 4, 8] for p in session.buckets}
    engine = Engine(session, drafter=oracle_drafter(expected) if drafting == "oracle" else None)
    steps = []

    def on_step(step):
        steps.append(step)
        assert not (engine.free and engine.waiting), "a slot stayed free while requests waited"
        slots = [r.slot for r in engine.active]
        assert len(set(slots)) == len(slots) and set(slots) <= set(range(SLOTS))

    states = engine.generate(requests, on_step)
    for state, want in zip(states, expected):
        assert_same_tokens(state.tokens, want, f"request {state.id}")
        assert state.finish_reason == ("stop" if want[-1] in state.stop else "length")

    stats = engine.stats.as_dict()
    for name in COUNTERS:  # the per-step dicts add up to the cumulative one
        assert sum(getattr(step, name) for step in steps) == stats[name], name
    assert stats["admitted"] == stats["retired"] == REQUESTS
    assert stats["slot_reuse"] == REQUESTS - SLOTS
    assert stats["generated"] == sum(len(s.tokens) for s in states)
    assert stats["drafted"] == 7 * stats["rows"] and stats["bonus"] == stats["rows"]
    assert stats["acceptance_rate"] == stats["accepted"] / stats["drafted"]
    assert stats["padding_rows"] > 0  # odd batches happened, and padded into the scratch slot
    assert max(step.rows for step in steps) == SLOTS
    if drafting == "oracle":
        assert stats["mean_accepted_per_step"] > 2 and stats["tokens_per_step"] == pytest.approx(
            1 + stats["mean_accepted_per_step"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_reused_slot_decodes_like_a_fresh_one(small_pkg, temperature):
    """B takes the slot A leaves, in the step A finishes; it must not see any of A's state.

    A is long (past the window, several compressed entries, odd length so the ratio-2
    compressor state holds an open group); B is short, so A's rows sit beyond B's
    positions in every cache. Margins are compared too: equal floats mean equal logits.
    """
    gen = torch.Generator().manual_seed(21)
    a = Request(random_tokens(gen, 301), 10, seed=1, id="a")
    b = Request(random_tokens(gen, 51), 12, seed=2, id="b")
    engine = Engine(small_pkg.session(slots=1), temperature=temperature)
    steps = []
    old, new = engine.generate([a, b], steps.append)
    assert old.slot == new.slot == 0 and engine.stats.slot_reuse == 1
    assert any(s.retired == 1 and s.admitted == 1 for s in steps)  # handed over within one step

    fresh = Engine(small_pkg.session(slots=1), temperature=temperature).generate([b])[0]
    assert new.tokens == fresh.tokens and len(new.tokens) == 12
    assert new.margins == fresh.margins


def poison_scratch_slot(session) -> None:
    """The scratch slot's rows of every per-slot cache (it holds no page: padding rows read none)."""
    paged = {id(t) for caches in session.pages.caches.values() for t in caches.values()}
    assert all(int(table[session.scratch_slot].max()) == -1 for table in session.pages.tables.values())
    for cache in (c for c in session.caches.values() if id(c) not in paged):
        row = cache[session.scratch_slot]
        row.fill_(0xFF) if cache.dtype == torch.uint8 else row.fill_(-1)


def test_poisoning_the_scratch_slot_before_every_step_changes_nothing(small_pkg):
    gen = torch.Generator().manual_seed(31)
    requests = [Request(random_tokens(gen, n), k) for n, k in ((3, 9), (140, 5), (1, 12), (70, 7), (20, 3))]
    clean = Engine(small_pkg.session(slots=5)).generate(requests)

    session = small_pkg.session(slots=5)
    engine = Engine(session)
    engine.submit(requests)
    while engine.busy:
        poison(session)  # staging, static inputs and outputs
        poison_scratch_slot(session)
        engine.step()
        # Padding rows write the scratch slot's device-side length; a live slot's must be its own.
        assert session.caches["cache.seq_len"][:5].tolist() == session.seq_lens[:5]
    assert engine.stats.padding_rows > 0  # 5 rows pad to 8, 3 to 4: padding rows ran
    for want, got in zip(clean, sorted(engine.finished, key=lambda s: s.id)):
        assert got.tokens == want.tokens and got.margins == want.margins


def test_engine_generate_takes_prompts_and_requests(small_pkg):
    session = small_pkg.session(slots=2)
    states = Engine(session).generate([[5, 6, 7], Request([8], 3, id="x")])
    assert [s.id for s in states] == [0, "x"]
    assert len(states[0].tokens) == 32 and len(states[1].tokens) == 3
    want, _ = greedy_alone(small_pkg, [5, 6, 7], 32)
    assert_same_tokens(states[0].tokens, want)


def test_the_last_tokens_before_max_seq_len_decode_one_at_a_time(small_pkg):
    """Verify scores verify_width positions ahead, so near max_seq_len the engine decodes
    through prefill, one token per step, and a request may fill the context exactly.

    Checked by teacher forcing: one prefill of prompt + tokens gives the target's argmax
    at every position, and each emitted token must be it (or sit at a near tie).
    """
    limit = small_pkg.manifest.model.max_seq_len
    gen = torch.Generator().manual_seed(41)
    prompt, new = random_tokens(gen, limit - 14), 14
    session = small_pkg.session(slots=1)
    engine = Engine(session)
    calls, replay = [], session.replay

    def counted(name, **values):
        calls.append((name, values.get("new_tokens")))
        return replay(name, **values)

    session.replay = counted
    state = engine.generate([Request(prompt, new)])[0]
    assert len(state.tokens) == new and state.length == limit - 1  # the last token is emitted, never committed
    assert ("prefill", [1]) in calls  # the tail went through prefill

    reference = small_pkg.session(slots=1)
    sequence, argmax = prompt + state.tokens[:-1], []
    for start in range(0, len(sequence), 64):
        piece = sequence[start : start + 64]
        logits = reference.replay("prefill", token_ids=[piece + [0] * (64 - len(piece))], slot_ids=[0],
                                  positions=[start], new_tokens=[len(piece)])["logits"][0, : len(piece)]
        argmax += logits.argmax(-1).tolist()
    assert_same_tokens(state.tokens, argmax[len(prompt) - 1:])
