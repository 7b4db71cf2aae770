"""Speculative decoding produces exactly the tokens of plain greedy decoding."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.serving.speculative import Decoder
from conftest import random_tokens
from same_tokens import assert_same_tokens

LENGTHS = (1, 40, 200)  # one token, short, past the 128-token window


def _prompts(seed=11):
    gen = torch.Generator().manual_seed(seed)
    return [random_tokens(gen, n) for n in LENGTHS]


@pytest.fixture(scope="module")
def greedy(small_pkg):
    decoder = Decoder(small_pkg.session(slots=3, max_rows=4))
    tokens = decoder.generate(_prompts(), 48, speculative=False)
    return tokens


def test_draft_pass_speculation_equals_greedy(small_pkg, greedy):
    want = greedy
    decoder = Decoder(small_pkg.session(slots=3, max_rows=4))
    got = decoder.generate(_prompts(), 48)
    for slot in range(3):
        assert_same_tokens(got[slot], want[slot], f"request {slot}")
    stats = decoder.stats.as_dict()
    assert stats["drafted"] >= 7 * stats["steps"]  # every step drafted a full block per row


def test_accepted_drafts_commit_correctly(small_pkg, greedy):
    """A drafter that is right for a random number of tokens makes verify accept 0..7 drafts
    per step, so multi-row commits feed later steps; the output must still be greedy's."""
    want = greedy
    gen = torch.Generator().manual_seed(5)
    accepted_counts = set()

    def drafter(rows):
        out = []
        for row in rows:
            done = len(row.tokens)
            right = int(torch.randint(0, 8, (1,), generator=gen))
            truth = want[row.slot][done : done + 7]
            guess = truth[:right] + [(t + 1) % 512 for t in truth[right:]]
            out.append((guess + [0] * 7)[:7])
            accepted_counts.add(min(right, len(truth)))
        return out

    decoder = Decoder(small_pkg.session(slots=3, max_rows=4), drafter=drafter)
    got = decoder.generate(_prompts(), 48)
    for slot in range(3):
        assert_same_tokens(got[slot], want[slot], f"request {slot}")
    stats = decoder.stats.as_dict()
    assert stats["accepted"] > 0 and stats["tokens_per_step"] > 1.5
    assert {0, 7} <= accepted_counts  # both no acceptance and full acceptance happened
    assert decoder.stats.steps < greedy_steps(want)


def greedy_steps(tokens):
    return max(len(t) for t in tokens)
