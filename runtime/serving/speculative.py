"""Speculative decoding over a session: draft -> verify -> accept -> commit.

Per row: `length` tokens are committed to the caches and `pending` is the next token,
already chosen but not yet in the caches. A step drafts a block [pending, noise x6]
(row j proposes the token at length+j+1), verifies [pending, d1..d7], accepts the
longest prefix the target agrees with plus the target's own next token (the bonus), and
commits pending and the accepted drafts. Greedy decoding is the same loop with no drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Stats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    generated: int = 0
    prefill_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        per_step = self.generated / self.steps if self.steps else 0.0
        tps = self.generated / self.seconds if self.seconds else 0.0
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": rate, "tokens_per_step": per_step, "generated": self.generated,
                "prefill_tokens": self.prefill_tokens, "tokens_per_second": tps}


@dataclass
class Row:
    slot: int
    length: int = 0
    pending: int = -1
    tokens: list[int] = field(default_factory=list)


class Decoder:
    def __init__(self, session, drafter=None, prefix_cache=None):
        """`drafter(rows) -> list of draft lists` replaces the draft pass (e.g. an external drafter);
        `prefix_cache` (runtime/prefix/cache.py) lets prefill skip a stored prefix of the prompt."""
        self.session = session
        self.drafter = drafter
        self.prefix_cache = prefix_cache
        self.margins: dict[int, list[float]] = {}  # slot -> top-2 logit gap behind each token
        self.verify_width = session.package.passes["verify"].width
        self.draft_width = session.package.passes["draft"].width
        self.chunk = session.package.passes["prefill"].width
        self.noise = session.package.manifest["model"]["noise_token_id"]
        self.stats = Stats()

    def prefill(self, slot: int, prompt: list[int]) -> Row:
        """Prefill a prompt into a slot chunk by chunk; the row's pending token is its argmax."""
        if not prompt:
            raise ValueError("prompt is empty; at least one token is needed")
        self.session.reset_slot(slot)
        row = Row(slot)
        cache = self.prefix_cache
        hit = cache.restore(self.session, slot, prompt) if cache is not None else None
        if hit is not None:  # the slot now holds the first hit.length tokens
            row.length = hit.length
            last = hit.snapshot.logits  # used only when the hit covers the whole prompt
        for start in range(row.length, len(prompt), self.chunk):
            piece = prompt[start : start + self.chunk]
            tokens = piece + [0] * (self.chunk - len(piece))
            out = self.session.replay("prefill", tokens=[tokens], row_ids=[slot], positions=[row.length],
                                      lengths=[len(piece)])
            row.length += len(piece)
            last = out["logits"][0, len(piece) - 1]
            if cache is not None and cache.boundary(row.length, len(prompt)):
                cache.store(self.session, slot, prompt[: row.length], last)
        row.pending = int(last.argmax())
        row.tokens.append(row.pending)
        self.margins[slot] = [_margin(last)]
        self.stats.prefill_tokens += len(prompt)
        return row

    def step(self, rows: list[Row], speculative: bool = True) -> None:
        """One decoding step for all rows together; appends 1 to verify_width tokens per row."""
        slots = [r.slot for r in rows]
        positions = [r.length for r in rows]
        if speculative and self.drafter is not None:
            drafts = [list(d) for d in self.drafter(rows)]
        elif speculative:
            block = [[r.pending] + [self.noise] * (self.draft_width - 1) for r in rows]
            draft = self.session.replay("draft", tokens=block, row_ids=slots, positions=positions)
            drafts = confident_drafts(draft, self.session.package.manifest)
        else:
            drafts = [[self.noise] * (self.verify_width - 1) for _ in rows]
        pad = self.verify_width - 1
        candidates = [([r.pending] + d + [self.noise] * pad)[: pad + 1] for r, d in zip(rows, drafts)]
        verify = self.session.replay("verify", tokens=candidates, row_ids=slots, positions=positions)
        logits = verify["logits"]
        targets = logits.argmax(-1).tolist()
        accept = []
        for i, (row, drafted, target) in enumerate(zip(rows, drafts, targets)):
            k = 0
            if speculative:
                while k < len(drafted) and drafted[k] == target[k]:
                    k += 1
                self.stats.drafted += len(drafted)
                self.stats.accepted += k
            row.tokens += target[: k + 1]  # accepted drafts equal the target's picks, then the bonus
            row.pending = target[k]
            self.margins[row.slot] += [_margin(logits[i, j]) for j in range(k + 1)]
            accept.append(k + 1)
            self.stats.generated += k + 1
        self.session.replay("commit", row_ids=slots, positions=positions, accept_len=accept)
        for row, count in zip(rows, accept):
            row.length += count
        self.stats.steps += 1

    def generate(self, prompts: list[list[int]], max_new_tokens: int, speculative: bool = True) -> list[list[int]]:
        """Decode every prompt in its own slot, all rows stepped together; greedy when not speculative."""
        if len(prompts) > self.session.slots:
            raise ValueError(f"{len(prompts)} prompts need {len(prompts)} slots; the session has {self.session.slots}")
        start = time.perf_counter()
        rows = [self.prefill(slot, prompt) for slot, prompt in enumerate(prompts)]
        limit = self.session.package.manifest["model"]["max_seq_len"] - self.verify_width
        while True:
            active = [r for r in rows if len(r.tokens) < max_new_tokens and r.length <= limit]
            if not active:
                break
            for i in range(0, len(active), self.session.max_rows):
                self.step(active[i : i + self.session.max_rows], speculative)
        self.stats.seconds += time.perf_counter() - start
        return [r.tokens[:max_new_tokens] for r in rows]


def confident_drafts(out: dict, manifest: dict) -> list[list[int]]:
    """Greedy drafts per row from a draft pass's outputs, ended at the first row whose
    confidence (DSpark's sigmoid head) is below the package's threshold."""
    drafts = out["logits"].argmax(-1).tolist()
    return [d[:n] for d, n in zip(drafts, confident_lengths(out, manifest))]


def confident_lengths(out: dict, manifest: dict) -> list[int]:
    rows, width = out["logits"].shape[:2]
    threshold = manifest["model"].get("confidence_threshold", 0.0)
    if "confidence" not in out or threshold <= 0:
        return [width] * rows
    low = (out["confidence"] < threshold).to(torch.int64)
    # index of the first low row, or width when there is none
    first = torch.where(low.any(dim=1), low.argmax(dim=1), torch.full((rows,), width))
    return first.tolist()


def _margin(logits: torch.Tensor) -> float:
    """Gap between the two largest logits: how close the argmax was to a tie."""
    top = logits.topk(2).values
    return float(top[0] - top[1])
