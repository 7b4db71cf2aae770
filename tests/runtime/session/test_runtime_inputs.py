"""Bad buffers and bad replay inputs are rejected before any replay; caches stay unchanged."""

from __future__ import annotations

import pytest
import torch

import paging
from b12x_toolchain.runtime.serving.speculative import Decoder
from b12x_toolchain.runtime.session.validate import BufferError, InputError

pytestmark = pytest.mark.slow(minutes=0.5)


@pytest.fixture(scope="module")
def specs(fused_pkg):
    shared = {}
    for info in fused_pkg.passes.values():
        for spec in info.inputs:
            if spec.role in ("cache", "staging"):
                shared[spec.name] = spec
    return shared


def _good(spec, slots=2, rows=8):
    """What the session would allocate: pools of its default size (every slot at max_seq_len)."""
    return torch.zeros(spec.resolve({**paging.symbols([spec], slots), "slots": slots + 1, "rows": rows}),
                       dtype=spec.torch_dtype)


FAULTS = {
    "dtype": lambda t: t.to(torch.float32) if t.dtype != torch.float32 else t.to(torch.int32),
    "shape": lambda t: t[..., :-1] if t.dim() > 1 else t[:-1],
    "device": lambda t: t.to("meta"),
    "stride": lambda t: t.transpose(0, -1).contiguous().transpose(0, -1),
}
BUFFERS = ["cache.layer0.window", "cache.layer2.state", "cache.layer4.compressed", "cache.draft1.window",
           "cache.seq_len", "staging.verify.layer3.window", "staging.verify.layer2.compressed",
           "staging.draft.draft0.window"]
# A one-dimensional buffer has only one stride, so it gets every fault but that one.
BUFFER_FAULTS = [(b, f) for b in BUFFERS for f in sorted(FAULTS) if not (b == "cache.seq_len" and f == "stride")]


@pytest.mark.parametrize("name, fault", BUFFER_FAULTS)
def test_bad_buffer_is_refused_naming_it(fused_pkg, specs, name, fault):
    bad = FAULTS[fault](_good(specs[name]))
    with pytest.raises(BufferError, match=rf"^{name}: "):
        fused_pkg.session(slots=2, max_rows=8, buffers={name: bad})


@pytest.fixture(scope="module")
def primed(fused_pkg):
    """Shared by the input tests: each checks that its refusal changed nothing."""
    session = fused_pkg.session(slots=3, max_rows=4)
    decoder = Decoder(session)
    decoder.prefill(0, list(range(1, 150)))
    decoder.prefill(1, [5, 6, 7])
    return session


BAD_INPUTS = [
    ("verify", dict(token_ids=[[1] * 8], slot_ids=[3], positions=[0]), r"slot_ids: value 3 is out of range"),
    ("verify", dict(token_ids=[[1] * 8], slot_ids=[-2], positions=[0]), r"slot_ids: value -2 is out of range"),
    ("verify", dict(token_ids=[[1] * 8] * 2, slot_ids=[1, 1], positions=[3, 3]), r"repeats a slot"),
    ("verify", dict(token_ids=[[1] * 8], slot_ids=[1], positions=[4]), r"positions: \[4\] do not continue .* \[3\]"),
    ("verify", dict(token_ids=[[1] * 8], slot_ids=[0], positions=[100]), r"positions: \[100\] do not continue"),
    ("verify", dict(token_ids=[[512] + [1] * 7], slot_ids=[1], positions=[3]), r"token_ids: value 512 is out of range"),
    ("verify", dict(token_ids=[[-1] + [1] * 7], slot_ids=[1], positions=[3]), r"token_ids: value -1 is out of range"),
    ("verify", dict(token_ids=[[1] * 7], slot_ids=[1], positions=[3]), r"token_ids: shape \(1, 7\)"),
    ("verify", dict(token_ids=torch.ones(1, 8, dtype=torch.int64), slot_ids=[1], positions=[3]), r"token_ids: dtype torch.int64"),
    ("verify", dict(token_ids=torch.ones(1, 8, dtype=torch.int32, device="meta"), slot_ids=[1], positions=[3]), r"token_ids: on device meta"),
    ("verify", dict(token_ids=[[1] * 8] * 5, slot_ids=[0, 1, 2, 0, 1], positions=[1] * 5), r"5 rows given; expected a 1-D list of 1 to 4"),
    ("verify", dict(token_ids=[], slot_ids=[], positions=[]), r"0 rows given"),
    ("verify", dict(token_ids=[[1] * 8], slot_ids=[1], positions=[3], extra=[1]),
     r"pass verify: no input of kind 'extra'; it takes kinds \['token_ids', 'slot_ids', 'positions', 'entry_block_table', "
     r"'index_key_block_table'\]"),
    ("verify", dict(tokens=[[1] * 8], slot_ids=[1], positions=[3]),  # an exporter's input name, not a kind
     r"no input of kind 'tokens' \('tokens' is the name of its token_ids input; a replay takes inputs by kind\)"),
    ("verify", dict(token_ids=[[1] * 8], positions=[3]), r"pass verify: inputs of kinds .* expected; missing \['slot_ids'\]"),
    ("draft", dict(token_ids=[["a"] * 7], slot_ids=[1], positions=[3]), r"token_ids: cannot be read as int32"),
    ("prefill", dict(token_ids=[[1] * 64], slot_ids=[2], positions=[0], new_tokens=[0]), r"new_tokens: value 0 is out of range"),
    ("prefill", dict(token_ids=[[1] * 64], slot_ids=[2], positions=[0], new_tokens=[65]), r"new_tokens: value 65 is out of range"),
    ("commit", dict(slot_ids=[1], positions=[3], accepted_tokens=[-1]), r"accepted_tokens: value -1 is out of range"),
    ("nope", dict(slot_ids=[1]), r"unknown pass 'nope'"),
]


@pytest.mark.parametrize("pass_name, values, message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_input_is_refused_and_caches_are_unchanged(primed, pass_name, values, message):
    before = {k: v.clone() for k, v in primed.caches.items()}
    lengths = list(primed.seq_lens)
    with pytest.raises((InputError, ValueError), match=message):
        primed.replay(pass_name, **values)
    assert primed.seq_lens == lengths
    for name, tensor in primed.caches.items():
        assert torch.equal(tensor, before[name]), name


def test_positions_beyond_the_model_limit_are_refused(small_path):
    from b12x_toolchain.runtime import load

    package = load(small_path)
    limit = package.manifest.model.max_seq_len
    session = package.session(slots=1)
    # A slot five tokens short of the limit (as if prefilled that far): a verify of 8 rows would
    # write past it.
    session.set_committed_length(0, limit - 5)
    with pytest.raises(InputError, match=rf"positions: value {limit + 3} is out of range; expected positions \+ width"):
        session.replay("verify", token_ids=[[1] * 8], slot_ids=[0], positions=[limit - 5])
