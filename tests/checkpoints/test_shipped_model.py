"""The shipped trained model (checkpoints/dsv41-mini): its files as committed, exported from
its release-layout checkpoint with its tokenizer, a tokenizer that gives back the held-out
split, a drafter the target accepts, and speculative sampling that keeps the target's
distribution at temperature 0.8."""

from __future__ import annotations

import hashlib

import pytest
import torch

from b12x_toolchain.exporter.train.corpus import load_corpus
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from b12x_toolchain.runtime.serving.sampling import accept_sampled, probabilities
from b12x_toolchain.runtime.serving.speculative import Decoder
from chi_square import chi_square_p_value
from paths import SHIPPED_CHECKPOINT
from runtime.serving.test_sampling import P_VALUE, first_tokens, keep_every_draft

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow(minutes=0.7)]
SUMS = SHIPPED_CHECKPOINT / "SHA256SUMS"
MAX_BYTES = 20 * 2**20
NEW_TOKENS = 48
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def package(shipped_path):
    return load(shipped_path)


@pytest.fixture(scope="module")
def heldout_prompt(package):
    """64 tokens of the first held-out file long enough, past its header."""
    ids = next(ids for ids in (package.tokenizer.encode(text) for text in load_corpus().heldout) if len(ids) >= 256)
    return ids[128:192]


def test_the_checkpoint_files_are_the_committed_ones():
    listed = dict(reversed(line.split(maxsplit=1)) for line in SUMS.read_text().splitlines())
    present = sorted(p.name for p in SHIPPED_CHECKPOINT.iterdir() if p != SUMS)
    assert sorted(listed) == present
    for name, digest in listed.items():
        assert hashlib.sha256((SHIPPED_CHECKPOINT / name).read_bytes()).hexdigest() == digest, name
    assert sum((SHIPPED_CHECKPOINT / name).stat().st_size for name in listed) <= MAX_BYTES


def test_the_package_takes_the_checkpoint_tokenizer(package):
    codec = package.tokenizer
    assert codec is not None and codec.vocab_size == package.vocab_size
    assert codec.decode(codec.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"


def test_the_tokenizer_gives_back_the_heldout_split(package):
    codec = package.tokenizer
    for text in load_corpus().heldout:
        assert codec.decode(codec.encode(text)) == text


def test_the_drafter_is_accepted_and_greedy_output_is_unchanged(package, heldout_prompt):
    session = package.session(slots=1)
    speculative = Engine(session)
    tokens = speculative.generate([Request(heldout_prompt, NEW_TOKENS)])[0].tokens
    stats = speculative.stats.as_dict()
    assert stats["accepted"] * 3 >= stats["steps"], stats  # at least one accepted draft per three steps
    assert Engine(session, speculative=False).generate([Request(heldout_prompt, NEW_TOKENS)])[0].tokens == tokens


def test_speculative_sampling_keeps_the_target_distribution(package, heldout_prompt):
    """At one state (the prompt committed, a pending token the drafter does not expect), the first
    token a speculative step emits at temperature 0.8 follows the target's distribution."""
    session = package.session(slots=1)
    prompt, pending = heldout_prompt[:-1], heldout_prompt[-1]
    Decoder(session).prefill(0, prompt)
    at = dict(slot_ids=[0], positions=[len(prompt)])
    noise = package.manifest.model.noise_token_id
    q = probabilities(session.replay("draft", token_ids=[[pending] + [noise] * 6], **at)["logits"][0], TEMPERATURE)
    p = probabilities(session.replay("verify", token_ids=[[pending] + [noise] * 7], **at)["logits"][0], TEMPERATURE)
    assert float(torch.minimum(p[0], q[0]).sum()) < 0.97  # q differs from p enough to tell samplers apart
    samples = 20000
    assert chi_square_p_value(first_tokens(accept_sampled, p, q, samples, 7), p[0]) > P_VALUE
    assert chi_square_p_value(first_tokens(keep_every_draft, p, q, samples, 7), p[0]) < 1e-9
