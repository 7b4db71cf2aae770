"""A token's numbers do not depend on the pass that computed it: decode, verify's first row,
a one-token prefill and a whole prefill give the same logits to the bit, and leave the same
cache bytes, prefilled whole, in chunks of 7, or a token at a time (runtime/ops/fixed_order.py).

The small recipe in its V4.1 cache records (FP8 window rows, FP4 entries and index keys),
with float32 weights and in the release's FP8/FP4 weight formats, along a greedy sequence
(benchmarks/exact_decoding.py checks the shipped model on 214 held-out prompts the same way).
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime import load
from benchmarks.exact_decoding import fresh, passes_agree, prefill
from conftest import random_tokens

STEPS = 12


@pytest.fixture(scope="module", params=["small_path", "small_release_path"])
def package(request):
    return load(request.getfixturevalue(request.param))


def test_every_pass_gives_a_token_the_decode_passs_bits(package):
    gen = torch.Generator().manual_seed(11)
    prompts = [random_tokens(gen, 40), random_tokens(gen, 9)]  # two slots of one session, stepped together
    session = fresh(package, len(prompts))
    greedy = [[int(rows[-1].argmax())] for rows in prefill(session, prompts)]
    for step in range(STEPS):  # the greedy continuations, through the decode pass
        out = session.replay("decode", token_ids=[[g[-1]] for g in greedy], slot_ids=[0, 1],
                             positions=[len(p) + step for p in prompts], new_tokens=[1, 1])
        for row, g in enumerate(greedy):
            g.append(int(out["logits"][row, 0].argmax()))
    found = passes_agree(package, prompts, [g[:-1] for g in greedy])
    differ = sum(step.count(False) for step in found["steps_equal"])
    assert differ == 0, f"steps where the passes differ: {differ}"
    assert [rows.argmax(-1).tolist() for rows in found["logits"]] == greedy
    assert found["same_caches"], "a whole, chunked or token-by-token prefill left other cache bytes"
