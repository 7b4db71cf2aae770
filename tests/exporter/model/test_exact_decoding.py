"""A token's numbers do not depend on the pass that computed it: decode, verify's first row,
a one-token prefill and a whole prefill give the same logits to the bit, and leave the same
cache bytes, prefilled whole, in chunks of 7, or a token at a time (runtime/ops/fixed_order.py).

The small recipe in its V4.1 cache records (FP8 window rows, FP4 entries and index keys),
with float32 weights and in the release's FP8/FP4 weight formats, along a greedy sequence
(benchmarks/exact_decoding.py checks the shipped model on 200 held-out prompts the same way).
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
    prompt = random_tokens(torch.Generator().manual_seed(11), 40)
    greedy = [int(prefill(fresh(package), prompt)[-1].argmax())]
    session = fresh(package)
    prefill(session, prompt)
    for step in range(STEPS):  # the greedy continuation, through the decode pass
        out = session.replay("decode", token_ids=[[greedy[-1]]], slot_ids=[0], positions=[len(prompt) + step],
                             new_tokens=[1])
        greedy.append(int(out["logits"][0, 0].argmax()))
    found = passes_agree(package, prompt, greedy[:-1])
    assert all(found["steps_equal"]), f"steps where the passes differ: {found['steps_equal'].count(False)}"
    assert found["logits"].argmax(-1).tolist() == greedy
    assert found["same_caches"], "a whole, chunked or token-by-token prefill left other cache bytes"
