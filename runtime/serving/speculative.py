"""Greedy speculative decoding of a list of prompts, one slot each: a facade over the engine.

`Decoder` keeps the calls a caller who drives slots by hand wants — `prefill(slot, prompt)`,
`step(rows)`, `generate(prompts, max_new_tokens)` — and runs each through `Engine`, so
there is one serving loop: the same prefill (prefix cache included), draft, verify,
accept and commit, and one record per request (`RequestState`). Per row, `length` tokens
are committed and `pending` is the next token, chosen but not yet in the caches; a step
drafts [pending, noise...], verifies [pending, d1..d7], accepts the longest prefix the
target agrees with plus the target's own next token, and commits. Sampling and many
requests over reused slots are the engine's own API.
"""

from __future__ import annotations

import time

from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request, RequestState
from b12x_toolchain.runtime.serving.stats import EngineStats, StepStats


class Decoder:
    def __init__(self, session, drafter=None, prefix_cache=None):
        """`drafter(rows) -> one list of draft_width token ids per row` replaces the draft pass;
        `prefix_cache` (runtime/prefix/cache.py) lets prefill skip a stored prefix of the prompt."""
        self.session, self.drafter, self.prefix_cache = session, drafter, prefix_cache
        self.margins: dict[int, list[float]] = {}  # slot -> top-2 logit gap behind each token
        self.stats = EngineStats()  # every engine this decoder drives counts here
        self._engines: dict[bool, Engine] = {}

    def engine(self, speculative: bool = True, slots=None) -> Engine:
        """A greedy engine over this decoder's session, counting into `self.stats`."""
        if slots is None and speculative in self._engines:
            return self._engines[speculative]
        engine = Engine(self.session, speculative=speculative, drafter=self.drafter,
                        prefix_cache=self.prefix_cache, slots=slots)
        engine.stats = self.stats
        if slots is None:  # engines over given slots are one-off (generate's prompt i -> slot i)
            self._engines[speculative] = engine
        return engine

    def prefill(self, slot: int, prompt: list[int]) -> RequestState:
        """Prefill a prompt into a slot; the row's pending token is the target's first token."""
        engine = self.engine()
        room = max(1, engine.max_seq_len - len(prompt))  # rows driven by hand may run to max_seq_len
        (row,) = engine.new_states([Request(list(prompt), max_new_tokens=room)], check_pages=False)
        row.slot = slot
        self._run(lambda stats: engine.prefill_batch([row], stats, reserve=False))
        self.margins[slot] = row.margins
        return row

    def step(self, rows: list[RequestState], speculative: bool = True) -> None:
        """One decoding step for all rows together; appends 1 to verify_width tokens per row."""
        engine = self.engine(speculative)
        self._run(lambda stats: engine.decode_group(rows, stats))

    def generate(self, prompts: list[list[int]], max_new_tokens: int, speculative: bool = True) -> list[list[int]]:
        """Decode prompt i in slot i, all rows stepped together; plain greedy when not speculative.

        Each prompt gets at most the tokens that fit before max_seq_len."""
        if len(prompts) > self.session.slots:
            raise ValueError(f"{len(prompts)} prompts need {len(prompts)} slots; the session has {self.session.slots}")
        engine = self.engine(speculative, slots=range(len(prompts)))
        limit = engine.max_seq_len
        requests = [Request(list(p), max_new_tokens=max(1, min(max_new_tokens, limit - len(p)))) for p in prompts]
        states = engine.generate(requests)
        for state in states:
            self.margins[state.slot] = state.margins
        return [state.tokens for state in states]

    def _run(self, work) -> None:
        stats = StepStats()
        start = time.perf_counter()
        work(stats)
        stats.decode_seconds = time.perf_counter() - start
        self.stats.record(stats)
