"""Fused and unfused packages write exactly the same staging and persistent cache bytes."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.serving.speculative import Decoder
from benchmarks.gpu_check import poisoned_step
from conftest import random_tokens

PROMPT_LENGTHS = (200, 37, 129, 1)  # past the window (ring wrapped), short, just past it, one token


def _open(pkg, gen_seed):
    session = pkg.session(slots=4, max_rows=4)
    decoder = Decoder(session)
    gen = torch.Generator().manual_seed(gen_seed)
    for slot, length in enumerate(PROMPT_LENGTHS):
        decoder.prefill(slot, random_tokens(gen, length))
    return session


def _fused_ops(pkg, pass_name):
    names = [str(n.target) for n in pkg.passes[pass_name].program.graph.nodes if n.op == "call_function"]
    return sum(name == "b12x_toolchain.window_snapshot_append.default" for name in names), \
        sum(name == "b12x_toolchain.window_snapshot.default" for name in names)


def test_packages_differ_in_the_window_ops(fused_pkg, unfused_pkg):
    # Guards the byte comparison below: it must compare a fused graph with an unfused one.
    assert _fused_ops(fused_pkg, "verify") == (6, 0)
    assert _fused_ops(unfused_pkg, "verify") == (0, 6)
    assert _fused_ops(fused_pkg, "draft") == (2, 0)
    assert _fused_ops(unfused_pkg, "draft") == (0, 2)


@pytest.mark.parametrize("rows", [1, 3])
def test_staging_and_persistent_bytes_identical(fused_pkg, unfused_pkg, rows):
    sessions = [_open(fused_pkg, 7), _open(unfused_pkg, 7)]
    gen = torch.Generator().manual_seed(100 + rows)
    slots = [3, 0, 2][:rows] if rows == 3 else [1]
    for step in range(3):
        positions = [sessions[0].seq_lens[s] for s in slots]
        draft_tokens = [random_tokens(gen, 7) for _ in slots]
        verify_tokens = [random_tokens(gen, 8) for _ in slots]
        accept = torch.randint(0, 9, (len(slots),), generator=gen).tolist()
        accept[0] = 8 if step == 0 else accept[0]  # at least one full-width commit
        outputs = [poisoned_step(session, slots, positions, draft_tokens, verify_tokens, accept)
                   for session in sessions]
        (d0, v0, s0), (d1, v1, s1) = outputs
        assert torch.equal(d0, d1) and torch.equal(v0, v1)
        assert s0.keys() == s1.keys()
        for name in s0:
            assert torch.equal(s0[name], s1[name]), f"staging {name} differs at step {step}"
        for name, cache in sessions[0].caches.items():
            assert torch.equal(cache, sessions[1].caches[name]), f"persistent {name} differs at step {step}"
    assert sessions[0].seq_lens == sessions[1].seq_lens


def test_window_staging_holds_snapshot_then_appended_rows(fused_pkg):
    """The staging layout is what the ops promise: history rows from the ring, then new rows."""
    from b12x_toolchain.runtime.formats.codecs import get_format
    from b12x_toolchain.runtime.formats.layout import token_view

    session = _open(fused_pkg, 3)
    slot, pos = 0, session.seq_lens[0]
    tokens = [random_tokens(torch.Generator().manual_seed(5), 8)]
    session.replay("verify", token_ids=tokens, slot_ids=[slot], positions=[pos])
    view = token_view(session.staging["staging.verify.layer0.window"])[0]
    ring = session.caches["cache.layer0.window"][slot]
    expected_history = ring[torch.remainder(torch.arange(pos - 128, pos), 128)]
    assert torch.equal(view[:128], expected_history)
    decoded = get_format("dsv41_mxfp8").decode(view[128:136], 64)
    assert torch.isfinite(decoded).all() and decoded.abs().sum() > 0
