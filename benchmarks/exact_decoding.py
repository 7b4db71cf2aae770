"""Exact decoding on the shipped trained model: every pass gives a token the same bits.

Prompts are cut at line ends from the held-out split of the training corpus (PER_FILE
spans of at least PROMPT_TOKENS tokens from each held-out file, MIN_PROMPTS or more), each
decoded NEW_TOKENS tokens at temperature 0, one thread:

* speculative = greedy: the engine decodes every prompt with its trained drafter and again
  through the decode pass without it, SLOTS requests at a time; the count of prompts whose
  tokens agree, token for token;
* the passes: along each greedy sequence, the decode pass's logits, verify's first row (and
  its commit) and a one-token prefill, step by step: the steps where all three are equal
  to the bit, and the prompts whose greedy tokens are the decode pass's argmax;
* the caches: each sequence prefilled whole, in chunks of 7, and decoded token by token
  (above): the prompts whose caches hold the same bytes all three ways.

Each row is a count against the number checked (ratio 1: exact everywhere).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer

from b12x_toolchain.exporter.train.corpus import load_corpus
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from benchmarks.registry import Measurement, Settings, benchmark, compare_counts
from benchmarks.trained_model import CHECKPOINT, export_shipped

MIN_PROMPTS = 200
PER_FILE = 5
PROMPT_TOKENS = 48
NEW_TOKENS = 64
SLOTS = 8


def line_prompts(tokenizer: Tokenizer, texts: list[str], per_file: int = PER_FILE) -> list[list[int]]:
    """Up to `per_file` prompts a text: whole lines from a line start, until PROMPT_TOKENS
    tokens or more, taken at even spacing through the text."""
    prompts = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        step = max(1, len(lines) // per_file)
        for start in range(0, len(lines), step)[:per_file]:
            chunk = ""
            for line in lines[start:]:
                chunk += line
                if len(tokenizer.encode(chunk).ids) >= PROMPT_TOKENS:
                    prompts.append(tokenizer.encode(chunk).ids)
                    break
    return prompts


def prefill(session, tokens: list[int], start: int = 0, piece: int | None = None, slot: int = 0) -> torch.Tensor:
    """Prefill `tokens` into `slot` from position `start`, `piece` tokens a replay (default
    the pass's chunk); every row's logits."""
    chunk = session.package.passes["prefill"].width
    piece = piece or chunk
    rows = []
    for at in range(0, len(tokens), piece):
        part = tokens[at:at + piece]
        out = session.replay("prefill", token_ids=[part + [0] * (chunk - len(part))], slot_ids=[slot],
                             positions=[start + at], new_tokens=[len(part)])
        rows.append(out["logits"][0, :len(part)].clone())
    return torch.cat(rows)


def fresh(package):
    session = package.session(slots=1, max_rows=1)
    session.reset_slot(0)
    return session


def passes_agree(package, prompt: list[int], continuation: list[int]) -> dict:
    """Feed `continuation` after `prompt` through decode, verify's first row + commit and a
    one-token prefill: per step, whether all three logits are equal; the decode pass's
    logits; and whether a whole and a 7-token-chunked prefill of the sequence leave the
    decode pass's cache bytes."""
    width = package.passes["verify"].width
    decode, verify, single = fresh(package), fresh(package), fresh(package)
    logits = [prefill(decode, prompt)[-1]]
    for session in (verify, single):
        prefill(session, prompt)
    sequence, equal = list(prompt), []
    for token in continuation:
        at = len(sequence)
        sequence.append(token)
        want = decode.replay("decode", token_ids=[[token]], slot_ids=[0], positions=[at], new_tokens=[1])["logits"][0, 0]
        block = [token] + sequence[max(0, at - width + 1):at]  # any drafts: row 0 sees none of them
        block += [0] * (width - len(block))
        got = verify.replay("verify", token_ids=[block], slot_ids=[0], positions=[at])["logits"][0, 0]
        verify.replay("commit", slot_ids=[0], positions=[at], accepted_tokens=[1])
        equal.append(torch.equal(got, want) and torch.equal(prefill(single, [token], start=at)[0], want))
        logits.append(want.clone())
    caches = {name: buffer.clone() for name, buffer in decode.caches.items()}
    same_caches = all(torch.equal(s.caches[n], caches[n]) for s in (verify, single) for n in caches)
    for piece in (None, 7):
        other = fresh(package)
        prefilled = prefill(other, sequence, piece=piece)
        same_caches &= all(torch.equal(other.caches[n], caches[n]) for n in caches)
        same_caches &= torch.equal(prefilled[len(prompt) - 1:], torch.stack(logits))
    return {"steps_equal": equal, "logits": torch.stack(logits), "same_caches": same_caches}


def engine_tokens(package, prompts: list[list[int]], speculative: bool) -> list[list[int]]:
    engine = Engine(package.session(slots=SLOTS), speculative=speculative)
    return [state.tokens for state in engine.generate([Request(p, NEW_TOKENS) for p in prompts])]


def measure(package, prompts: list[list[int]]) -> list[Measurement]:
    greedy = engine_tokens(package, prompts, speculative=False)
    speculative = engine_tokens(package, prompts, speculative=True)
    steps = argmax = caches = 0
    for prompt, tokens in zip(prompts, greedy):
        found = passes_agree(package, prompt, tokens[:-1])
        steps += sum(found["steps_equal"])
        argmax += found["logits"].argmax(-1).tolist() == tokens
        caches += found["same_caches"]
    n, params = len(prompts), {"prompts": len(prompts), "new_tokens": NEW_TOKENS, "slots": SLOTS}
    return [
        compare_counts("exact_decoding.speculative_is_greedy", "prompts, token for token", n,
                       sum(s == g for s, g in zip(speculative, greedy)), "prompts", "checked", "equal", params),
        compare_counts("exact_decoding.passes", "steps: decode = verify row 0 = one-token prefill, bitwise",
                       sum(len(g) - 1 for g in greedy), steps, "steps", "checked", "equal", params),
        compare_counts("exact_decoding.passes", "prompts: greedy tokens = the decode pass's argmax", n, argmax,
                       "prompts", "checked", "equal", params),
        compare_counts("exact_decoding.caches", "prompts: whole, chunks of 7 and token by token, same bytes", n,
                       caches, "prompts", "checked", "equal", params),
    ]


@benchmark("exact_decoding")
def exact_decoding_benchmark(settings: Settings) -> list[Measurement]:
    tokenizer = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))
    prompts = line_prompts(tokenizer, list(load_corpus().heldout))
    if len(prompts) < MIN_PROMPTS:
        raise RuntimeError(f"{len(prompts)} held-out prompts, fewer than {MIN_PROMPTS}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="b12x-bench-") as tmp:
            return measure(export_shipped(Path(tmp)), prompts)
    finally:
        torch.set_num_threads(threads)
