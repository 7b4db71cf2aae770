"""The decode pass: one token per row into the caches, what verify + commit of one row gives."""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.serving.speculative import Decoder
from conftest import random_tokens


def _prefilled(package, prompt):
    session = package.session(slots=1, max_rows=1)
    Decoder(session).prefill(0, prompt)
    return session


def test_manifest_declares_a_one_token_pass_that_advances_by_lengths(small_pkg):
    info = small_pkg.passes["decode"]
    assert info.width == 1 and info.advances == "lengths" and info.reads_staging_of is None
    assert info.rows_buckets == small_pkg.passes["verify"].rows_buckets


def test_decode_equals_verify_then_commit_of_one_row(small_pkg):
    gen = torch.Generator().manual_seed(5)
    prompt, token = random_tokens(gen, 150), random_tokens(gen, 1)[0]  # past the window, groups closing
    noise = small_pkg.manifest.model.noise_token_id
    staged, direct = _prefilled(small_pkg, prompt), _prefilled(small_pkg, prompt)
    at = {"slot_ids": [0], "positions": [len(prompt)]}
    want = staged.replay("verify", token_ids=[[token] + [noise] * 7], **at)["logits"][0, 0].clone()
    staged.replay("commit", accepted_tokens=[1], **at)
    got = direct.replay("decode", token_ids=[[token]], new_tokens=[1], **at)["logits"][0, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # T=1 and T=8 products round apart
    assert direct.seq_lens[0] == staged.seq_lens[0] == len(prompt) + 1
    for name, spec in small_pkg.buffers.items():
        a, b = direct.caches.get(name), staged.caches.get(name)
        if a is None or torch.equal(a, b):
            continue
        # Where the bytes differ (a value that rounds to a neighbouring code), they decode to
        # values a code apart, never to something else.
        assert spec.info.format is not None, f"{name}: {spec.info.kind} bytes differ"
        codec = get_format(spec.info.format)
        rows = lambda t: codec.decode(t.reshape(-1, codec.row_bytes(spec.info.dims)), spec.info.dims)
        torch.testing.assert_close(rows(a), rows(b), rtol=0.15, atol=1e-5, msg=name)


def test_greedy_decoding_replays_decode_and_never_verify(small_pkg):
    session = small_pkg.session(slots=1, max_rows=1)
    decoder = Decoder(session)
    calls = []
    replay = session.replay
    session.replay = lambda name, **values: calls.append(name) or replay(name, **values)
    row = decoder.prefill(0, random_tokens(torch.Generator().manual_seed(6), 20))
    for _ in range(3):
        decoder.step([row], speculative=False)
    assert calls == ["prefill", "decode", "decode", "decode"] and len(row.tokens) == 4
