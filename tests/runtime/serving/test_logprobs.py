"""Logprobs, min_tokens, the greedy floor on temperature, and a request that fails alone.

Prompt logprobs must equal a fresh prefill's log-softmax at every position; generated
tokens' logprobs are the verify pass's own (checked against a fresh prefill of the
prompt plus the tokens before each)."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.prefix.cache import PrefixCache
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from conftest import random_tokens
from decode_steps import prefill
from failing_sampler import FAILING_TEMPERATURE, fail_sampling_at

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOP = 3


def fresh_logprobs(pkg, tokens: list[int]) -> torch.Tensor:
    """log_softmax of a fresh prefill of `tokens`, one row per position."""
    session = pkg.session(slots=1)
    session.reset_slot(0)
    return torch.log_softmax(prefill(session, 0, tokens).to(torch.float32), dim=-1)


def ranked(row: torch.Tensor, top: int) -> list[int]:
    values, ids = row.topk(top)
    return [i for _, i in sorted(zip((-values).tolist(), ids.tolist()))]


def test_prompt_logprobs_equal_a_fresh_prefill_at_every_position(small_pkg):
    prompt = random_tokens(torch.Generator().manual_seed(4), 90)  # more than one 64-token chunk
    (state,) = Engine(small_pkg.session(slots=2)).generate(
        [Request(prompt, 3, prompt_logprobs=TOP, logprobs=TOP)])
    expected = fresh_logprobs(small_pkg, prompt)
    assert len(state.prompt_token_logprobs) == len(prompt) - 1
    for position, entry in enumerate(state.prompt_token_logprobs):
        row = expected[position]
        assert abs(entry.logprob - float(row[prompt[position + 1]])) < 1e-5, position
        assert [t for t, _ in entry.top] == ranked(row, TOP)
        assert all(abs(v - float(row[t])) < 1e-5 for t, v in entry.top)
    # Generated tokens: greedy picks the top alternative, and the numbers are a fresh prefill's.
    whole = fresh_logprobs(small_pkg, prompt + state.tokens[:-1])
    assert len(state.token_logprobs) == len(state.tokens)
    for j, (token, entry) in enumerate(zip(state.tokens, state.token_logprobs)):
        assert entry.top[0][0] == token
        assert abs(entry.logprob - float(whole[len(prompt) - 1 + j][token])) < 1e-4, j


def test_prompt_logprobs_prefill_every_position_even_on_a_prefix_hit(small_pkg):
    session = small_pkg.session(slots=2)
    engine = Engine(session, prefix_cache=PrefixCache(small_pkg))
    prompt = random_tokens(torch.Generator().manual_seed(5), 70)
    plain, again = engine.generate([Request(prompt, 2)]), engine.generate([Request(prompt, 2)])
    assert again[0].cached_tokens > 0 and plain[0].cached_tokens == 0
    (asked,) = engine.generate([Request(prompt, 2, prompt_logprobs=0)])
    assert asked.cached_tokens == 0 and len(asked.prompt_token_logprobs) == len(prompt) - 1
    assert asked.tokens == plain[0].tokens


def test_samples_of_one_prompt_prefill_it_once(small_pkg):
    """n samples of a prompt: one prefill, the others restore its snapshot and share its pages;
    each draws as it would alone."""
    session = small_pkg.session(slots=4)
    prompt = random_tokens(torch.Generator().manual_seed(6), 70)
    samples = [Request(prompt, 4, id=j, seed=j, temperature=1.0) for j in range(4)]
    alone = [Engine(session).generate([Request(prompt, 4, seed=j, temperature=1.0)])[0].tokens for j in range(4)]
    engine = Engine(session, prefix_cache=PrefixCache(small_pkg))
    prefilled, replay = [], engine.executor._replay

    def counted(name, stats, **values):
        prefilled.extend(values["slot_ids"] if name == "prefill" else [])
        return replay(name, stats, **values)

    engine.executor._replay = counted
    states = engine.generate(samples)
    assert [s.tokens for s in states] == alone
    assert [s.cached_tokens for s in states] == [0] + [len(prompt)] * 3
    assert len(prefilled) == 2  # one row, two 64-token chunks


def test_a_denormal_temperature_decodes_greedily_and_infinity_is_refused(small_pkg):
    session = small_pkg.session(slots=2)
    prompt = [3, 1, 4, 1, 5, 9]
    greedy = Engine(session).generate([Request(prompt, 6)])[0]
    tiny = Engine(session).generate([Request(prompt, 6, temperature=5e-324, seed=1)])[0]
    assert (tiny.tokens, tiny.temperature) == (greedy.tokens, 0.0)
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            Engine(session).submit([Request(prompt, 2, temperature=bad)])


def test_min_tokens_holds_off_a_stop_token(small_pkg):
    session = small_pkg.session(slots=2)
    prompt = [2, 7, 1, 8, 2, 8]
    free = Engine(session).generate([Request(prompt, 8)])[0]
    stop = (free.tokens[0],)
    assert Engine(session).generate([Request(prompt, 8, stop)])[0].tokens == free.tokens[:1]
    held = Engine(session).generate([Request(prompt, 8, stop, min_tokens=4)])[0]
    assert held.tokens[:4] == free.tokens[:4] and len(held.tokens) >= 4
    assert held.finish_reason == ("stop" if stop[0] in free.tokens[4:] else "length")


def test_a_request_whose_sampling_fails_ends_alone(small_pkg, monkeypatch):
    """An error choosing one request's tokens fails that request; its neighbours decode as they
    would alone, and the engine goes on serving."""
    session = small_pkg.session(slots=4)
    others = [Request([3, 1, 4, 1, 5], 6, id="greedy"), Request([2, 7, 1, 8], 6, id="sampled", seed=3, temperature=1.0)]
    alone = [Engine(session).generate([r])[0].tokens for r in others]
    fail_sampling_at(monkeypatch)
    engine = Engine(session)
    states = engine.generate(others[:1] + [Request([6, 6, 6], 6, id="bad", temperature=FAILING_TEMPERATURE)] +
                             others[1:])
    bad = states[1]
    assert bad.finish_reason == "error" and "inf, nan" in bad.error and bad.tokens == []
    assert [s.tokens for s in (states[0], states[2])] == alone
    assert len(engine.free) == 4 and session.pages.stats()["pools"]  # every slot came back
    assert engine.generate([Request([3, 1, 4, 1, 5], 6)])[0].tokens == alone[0]
