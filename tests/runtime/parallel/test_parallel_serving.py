"""A parallel package on gloo, world size 2, in real processes, through the loader API: each
rank's teacher-forced logits are one device's (to 1e-5), and rank 0's engine, which the other
rank follows in lockstep (open_engine with a channel; follow_leader), decodes one device's
tokens: greedy, speculative, sampled with a seed, and with prefix hits.

The small recipe with float32 caches, tensor 2 and expert 2 over the two ranks (conftest.py
here). The mappings on one axis only are held to one device's logits layer by layer by
test_parallel_model; the command line's servers over both mappings: test_serve_ranks.
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime import EngineOptions, load, open_engine, open_prefix_cache
from b12x_toolchain.runtime.parallel.control import ControlChannel
from b12x_toolchain.runtime.serving.ranks import follow_leader
from b12x_toolchain.runtime.serving.requests import Request
from conftest import random_tokens
from decode_steps import incremental
from ranks import on_ranks

pytestmark = [pytest.mark.slow(minutes=0.8), pytest.mark.usefixtures("one_torch_thread")]  # two rank processes

# Teacher-forced: > 40 positions past both prompts, and past the 128-row window ring's first wrap.
LENGTH, PROMPTS = 176, [40, 77]
NEW_TOKENS = 12
ENGINES = {"greedy": EngineOptions(slots=2, speculative=False), "speculative": EngineOptions(slots=2),
           "sampled": EngineOptions(slots=2, temperature=0.8, seed=7)}


@pytest.fixture(scope="module")
def workload():
    gen = torch.Generator().manual_seed(19)
    sequences = [random_tokens(gen, LENGTH, vocab=2048) for _ in PROMPTS]
    prompts = [seq[:n] for seq, n in zip(sequences, PROMPTS)]
    return sequences, prompts + prompts[:1]  # the repeated prompt is a prefix hit


def decode(package, options: EngineOptions, prompts, channel=None) -> list[tuple[list[int], int]]:
    """Rank 0's (or one device's) tokens and cached prompt tokens per request, one at a time so
    the third finds the first's snapshot."""
    cache = open_prefix_cache(package, options, None if channel is None else channel.rank)
    engine = open_engine(package, options, cache, channel=channel)
    try:
        states = [engine.generate([Request(p, max_new_tokens=NEW_TOKENS)])[0] for p in prompts]
    finally:
        if channel is not None:
            engine.session.stop()
        cache.close()
    return [(s.tokens, s.cached_tokens) for s in states]


def serve(package, workload, channel=None) -> dict:
    sequences, prompts = workload
    out = {"logits": incremental(package, sequences, PROMPTS)}
    for name, options in ENGINES.items():
        if channel is None or channel.rank == 0:
            out[name] = decode(package, options, prompts, channel)
        else:
            follow_leader(package, options, channel)
    return out


def _serve_rank(rank, path, workload):
    package = load(path, rank=rank, peer_timeout=60)
    return serve(package, workload, ControlChannel(deadline_s=60, join_timeout_s=60))


def test_two_ranks_in_lockstep_serve_as_one_device(chat_path, chat_parallel_path, workload):
    one_device = serve(load(chat_path), workload)
    ranks = on_ranks(_serve_rank, 2, str(chat_parallel_path("tensor2-expert2")), workload)
    for rank, got in enumerate(ranks):
        for slot, (ours, ref) in enumerate(zip(got["logits"], one_device["logits"])):
            assert ours.shape == ref.shape and ours.shape[0] >= PROMPTS[slot] + 40
            err = (ours - ref).abs().max().item()
            print(f"rank {rank} request {slot}: {ours.shape[0]} positions, max |Δlogit| {err:.3g}")
            assert err < 1e-5, (rank, slot, err)
    for name in ENGINES:
        assert ranks[0][name] == one_device[name], name
        assert name not in ranks[1]  # rank 1 followed; it decided nothing
    assert one_device["greedy"][2][1] == PROMPTS[0]  # the repeated prompt was a whole-prompt hit
    assert [tokens for tokens, _ in one_device["speculative"]] == [tokens for tokens, _ in one_device["greedy"]]
