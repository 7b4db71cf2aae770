"""Session behaviour: stable buffers, slot reuse, and verify+commit consistent with prefill."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.serving.speculative import Decoder
from conftest import poison, random_tokens


def test_buffers_keep_address_and_size(fused_pkg):
    session = fused_pkg.session(slots=4, max_rows=4)
    before = session.buffer_addresses()
    decoder = Decoder(session)
    gen = torch.Generator().manual_seed(1)
    prompts = [random_tokens(gen, n) for n in (140, 3, 70)]
    decoder.generate(prompts, 12)  # rows 3 -> bucket 4
    decoder.generate(prompts[:1], 12)  # rows 1 -> bucket 1, slot 0 reused
    poison(session)
    decoder.generate([prompts[2], prompts[0]], 5)  # slots reused by other requests, bucket 2
    assert session.buffer_addresses() == before


def _verify_logits(session, slot, prompt, tokens):
    decoder = Decoder(session)
    decoder.prefill(slot, prompt)
    return session.replay("verify", token_ids=[tokens], slot_ids=[slot], positions=[len(prompt)])["logits"][0].clone()


def test_slot_reuse_matches_fresh_session(fused_pkg):
    gen = torch.Generator().manual_seed(2)
    old, new = random_tokens(gen, 300), random_tokens(gen, 90)
    tokens = random_tokens(gen, 8)
    reused = fused_pkg.session(slots=3, max_rows=4)
    Decoder(reused).prefill(2, old)  # slot 2 holds a longer, older request first
    got = _verify_logits(reused, 2, new, tokens)
    fresh = fused_pkg.session(slots=1, max_rows=4)
    want = _verify_logits(fresh, 0, new, tokens)
    assert torch.equal(got, want)
    # And whole generations: same tokens from a reused slot as from a fresh one.
    assert Decoder(reused).generate([new, old], 20)[0] == Decoder(fresh).generate([new], 20)[0]


@pytest.fixture(scope="module")
def consistency(fused_pkg):
    """Session A: prefill P, verify T (8 tokens), commit all 8. Session B: prefill P+T.

    151 + 8 = 159 tokens end inside an open ratio-2 group, so compressor state is compared too.
    """
    gen = torch.Generator().manual_seed(3)
    prompt, extra = random_tokens(gen, 151), random_tokens(gen, 8)
    a, b = fused_pkg.session(slots=1, max_rows=1), fused_pkg.session(slots=1, max_rows=1)
    for s in (a, b):
        for cache in s.caches.values():
            cache.fill_(0xFF) if cache.dtype == torch.uint8 else cache.fill_(-1)
    Decoder(a).prefill(0, prompt)
    verify = a.replay("verify", token_ids=[extra], slot_ids=[0], positions=[151])["logits"][0].clone()
    a.replay("commit", slot_ids=[0], positions=[151], accepted_tokens=[8])
    Decoder(b).prefill(0, prompt + extra)
    return a, b, verify


def test_commit_leaves_caches_like_prefill(consistency):
    a, b, _ = consistency
    assert a.seq_lens == b.seq_lens
    assert torch.equal(a.caches["cache.seq_len"], b.caches["cache.seq_len"])
    for name, cache_a in a.caches.items():
        cache_b = b.caches[name]
        if cache_a.dtype != torch.uint8:
            continue
        info = a.package.buffers[name].info  # what the cache is, as the manifest records it
        fmt, dim = info.format, info.dims
        # Rows of rings and records of pages alike (both sessions hand out pages in one order).
        cache_a, cache_b = (c.reshape(-1, get_format(fmt).row_bytes(dim)) for c in (cache_a, cache_b))
        # Which rows were written (ring indices, compressed slots, state rows) must match exactly.
        written_a, written_b = (cache_a != 0xFF).any(-1), (cache_b != 0xFF).any(-1)
        assert torch.equal(written_a, written_b), name
        assert written_a.any(), f"{name} was never written: the comparison would be empty"
        rows_a, rows_b = cache_a[written_a], cache_b[written_b]
        if fmt != "fp32":
            # Both sides compute the same fp32 values in different batch shapes (chunk 64
            # vs width 8), so they differ only by float reassociation (~1e-6 relative).
            # Quantised bytes agree unless a value sits that close to a rounding boundary:
            # expected for a small share of rows, never for most of them.
            differing = (rows_a != rows_b).any(-1).float().mean().item()
            assert differing <= 0.05, f"{name}: {differing:.1%} of rows differ"
        da, db = get_format(fmt).decode(rows_a, dim), get_format(fmt).decode(rows_b, dim)
        # A flipped rounding moves an element by one step of its format: 2^-3 of the
        # element for E4M3 (3 mantissa bits), one E2M1 gap (at most 2 block scales, i.e.
        # a third of the row's largest magnitude) for NVFP4, half of it for MXFP4 (a gap of 2 * 2^e
        # beside a block maximum of at least 4 * 2^e), ~1e-5 relative for fp32 state.
        scale = torch.maximum(da.abs(), db.abs())
        row_max = scale.amax(-1, keepdim=True)
        bound = {"dsv41_mxfp8": 0.125 * scale + 1e-6, "dsv41_nvfp4": row_max / 3 + 1e-6, "ocp_mxfp4": row_max / 2 + 1e-6,
                 "dsv41_mxfp4": row_max / 2 + 1e-6,
                 "fp32": 1e-4 * row_max + 1e-6}[fmt]
        assert ((da - db).abs() <= bound).all(), name


def test_verify_logits_match_prefill_logits(consistency, fused_pkg):
    a, b, verify = consistency
    gen = torch.Generator().manual_seed(3)
    prompt, extra = random_tokens(gen, 151), random_tokens(gen, 8)
    c = fused_pkg.session(slots=1, max_rows=1)
    Decoder(c).prefill(0, prompt[:128])
    # The last chunk covers positions 128..158; its rows 23..30 are positions 151..158.
    tail = prompt[128:] + extra
    out = c.replay("prefill", token_ids=[tail + [0] * (64 - len(tail))], slot_ids=[0], positions=[128],
                   new_tokens=[len(tail)])["logits"][0, 23:31]
    # Same positions, same inputs; only batch shapes differ (see above), and a value that
    # flips one quantisation step moves a logit by far less than 1e-3 at these widths.
    assert torch.allclose(verify, out, atol=1e-3, rtol=0)
    assert torch.equal(verify.argmax(-1), out.argmax(-1))
