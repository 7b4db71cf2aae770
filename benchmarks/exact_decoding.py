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

The passes and caches are checked SLOTS sequences at a time, each in its own slot of one
session (a row's bits do not depend on its neighbours, which is part of the claim), with
each slot's pages in a fixed place so that sessions compare byte for byte.

Each row is a count against the number checked (ratio 1: exact everywhere).
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from tokenizers import Tokenizer

from b12x_toolchain.exporter.train.corpus import load_corpus
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from benchmarks.registry import Measurement, Settings, benchmark, compare_counts
from benchmarks.trained_model import CHECKPOINT, export_shipped

MIN_PROMPTS = 200
PER_FILE = 4
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


def prefill(session, sequences: list[list[int]], starts: list[int] | None = None, piece: int | None = None,
            slots: list[int] | None = None) -> list[torch.Tensor]:
    """Prefill sequence i into slots[i] (default slot i) from position starts[i] (default 0),
    `piece` tokens a row and replay (default the pass's chunk), the rows together; every
    row's logits, per sequence."""
    chunk = session.package.passes["prefill"].width
    piece, starts = piece or chunk, starts or [0] * len(sequences)
    slots = slots or list(range(len(sequences)))
    logits = [[] for _ in sequences]
    for at in range(0, max(map(len, sequences)), piece):
        rows = [i for i, tokens in enumerate(sequences) if at < len(tokens)]
        parts = [sequences[i][at:at + piece] for i in rows]
        out = session.replay("prefill", token_ids=[part + [0] * (chunk - len(part)) for part in parts],
                             slot_ids=[slots[i] for i in rows],
                             positions=[starts[i] + at for i in rows], new_tokens=[len(part) for part in parts])
        for row, (i, part) in enumerate(zip(rows, parts)):
            logits[i].append(out["logits"][row, :len(part)].clone())
    return [torch.cat(rows) for rows in logits]


def fresh(package, slots: int = 1):
    """A session whose slot s holds its pages at s * pages_per_slot onwards, in order: two sessions
    that grow their slots in another order still place every row at the same bytes."""
    session = package.session(slots=slots, contiguous=True)
    for slot in range(slots):
        session.reset_slot(slot)
    return session


def passes_agree(package, prompts: list[list[int]], continuations: list[list[int]]) -> dict:
    """Feed continuation i after prompt i (slot i; the rows together) through decode, verify's
    first row + commit and a one-token prefill: per row and step, whether all three logits
    are equal; the decode pass's logits per row; and whether a whole and a 7-token-chunked
    prefill of the sequences leave the decode pass's cache bytes."""
    width, n = package.passes["verify"].width, len(prompts)
    decode, verify, single = (fresh(package, n) for _ in range(3))
    logits = [[rows[-1]] for rows in prefill(decode, prompts)]
    for session in (verify, single):
        prefill(session, prompts)
    sequences, equal = [list(p) for p in prompts], [[] for _ in prompts]
    for step in range(max(map(len, continuations))):
        rows = [i for i, tokens in enumerate(continuations) if step < len(tokens)]
        tokens, at = [continuations[i][step] for i in rows], [len(sequences[i]) for i in rows]
        common = dict(slot_ids=rows, positions=at)
        want = decode.replay("decode", token_ids=[[t] for t in tokens], new_tokens=[1] * len(rows), **common)["logits"]
        # Any drafts after the token: row 0 sees none of them.
        blocks = [([t] + sequences[i][max(0, a - width + 1):a] + [0] * width)[:width] for i, t, a in zip(rows, tokens, at)]
        got = verify.replay("verify", token_ids=blocks, **common)["logits"]
        verify.replay("commit", accepted_tokens=[1] * len(rows), **common)
        one = prefill(single, [[t] for t in tokens], at, slots=rows)
        for row, (i, t) in enumerate(zip(rows, tokens)):
            sequences[i].append(t)
            equal[i].append(torch.equal(got[row, 0], want[row, 0]) and torch.equal(one[row][0], want[row, 0]))
            logits[i].append(want[row, 0].clone())
    caches = {name: buffer.clone() for name, buffer in decode.caches.items()}
    same_caches = all(torch.equal(s.caches[name], caches[name]) for s in (verify, single) for name in caches)
    for piece in (None, 7):
        other = fresh(package, n)
        prefilled = prefill(other, sequences, piece=piece)
        same_caches &= all(torch.equal(other.caches[name], caches[name]) for name in caches)
        same_caches &= all(torch.equal(rows[len(p) - 1:], torch.stack(want)) for rows, p, want
                           in zip(prefilled, prompts, logits))
    return {"steps_equal": equal, "logits": [torch.stack(rows) for rows in logits], "same_caches": same_caches}


def engine_tokens(package, prompts: list[list[int]], speculative: bool) -> list[list[int]]:
    engine = Engine(package.session(slots=SLOTS), speculative=speculative)
    return [state.tokens for state in engine.generate([Request(p, NEW_TOKENS) for p in prompts])]


def measure(package, prompts: list[list[int]]) -> list[Measurement]:
    greedy = engine_tokens(package, prompts, speculative=False)
    speculative = engine_tokens(package, prompts, speculative=True)
    # SLOTS sequences a session, stepped together; the batches in a process per core, one thread each.
    batches = [(prompts[i:i + SLOTS], greedy[i:i + SLOTS]) for i in range(0, len(prompts), SLOTS)]
    with ProcessPoolExecutor(os.cpu_count() or 1, initializer=_open, initargs=(package.path,)) as pool:
        counts = list(pool.map(_batch_counts, batches))
    steps, argmax, caches = (sum(column) for column in zip(*counts))
    n, params = len(prompts), {"prompts": len(prompts), "new_tokens": NEW_TOKENS, "slots": SLOTS}
    return [
        compare_counts("exact_decoding.speculative_is_greedy", "prompts, token for token", n,
                       sum(s == g for s, g in zip(speculative, greedy)), "prompts", "checked", "equal", params),
        compare_counts("exact_decoding.passes", "steps: decode = verify row 0 = one-token prefill, bitwise",
                       sum(len(g) - 1 for g in greedy), steps, "steps", "checked", "equal", params),
        compare_counts("exact_decoding.passes", "prompts: greedy tokens = the decode pass's argmax", n, argmax,
                       "prompts", "checked", "equal", params),
        compare_counts("exact_decoding.caches", "prompts: whole, chunks of 7 and token by token, same bytes "
                       f"(checked {SLOTS} sequences a session)", n,
                       caches, "prompts", "checked", "equal", params),
    ]


_opened = {}


def _open(path) -> None:
    torch.set_num_threads(1)
    _opened["package"] = load(path)


def _batch_counts(batch) -> tuple[int, int, int]:
    """Steps where the passes agree, prompts whose greedy tokens are the decode pass's argmax,
    and prompts whose caches agree, for one batch of (prompts, greedy tokens)."""
    prompts, tokens = batch
    found = passes_agree(_opened["package"], prompts, [t[:-1] for t in tokens])
    return (sum(map(sum, found["steps_equal"])),
            sum(rows.argmax(-1).tolist() == t for rows, t in zip(found["logits"], tokens)),
            len(prompts) * found["same_caches"])


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
