"""The serving loop: many requests over the reused slots of one session.

A step is `schedule -> execute -> update`: the scheduler (scheduler.py) admits waiting
requests into free slots, the executor (executor.py) prefills them together, chunk by
chunk, and decodes every running request once — draft, verify, accept, commit — in groups
of at most the largest rows bucket (the session pads each group up to its nearest bucket
with rows that point at the scratch slot, so padding never touches a live slot); then the
scheduler retires the requests that finished (max_new_tokens or a stop token) and admits
waiting requests into the freed slots at once. The step returns its typed StepStats.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from b12x_toolchain.runtime.serving.draft_policy import DraftPolicy
from b12x_toolchain.runtime.serving.executor import Executor
from b12x_toolchain.runtime.serving.requests import Request, RequestState
from b12x_toolchain.runtime.serving.scheduler import Sampling, Scheduler, check_slots
from b12x_toolchain.runtime.serving.stats import EngineStats, StepStats

DECODE_PASSES = ("draft", "verify", "commit")


def passes_used(package_passes, speculative: bool = True, drafter=None, adaptive: bool = False) -> tuple[str, ...]:
    """The passes an engine replays: prefill, then decode for plain decoding where the package
    has it, else verify and commit, with draft when speculating without a drafter of its own,
    and decode as well when rows may step aside from drafting (`adaptive`, draft_policy.py).
    A session of just these deserialises no other graph."""
    if not speculative and "decode" in package_passes:
        return "prefill", "decode"
    aside = ("decode",) if speculative and adaptive and "decode" in package_passes else ()
    return ("prefill", "verify", "commit") + (("draft",) if speculative and drafter is None else ()) + aside


class Engine:
    def __init__(self, session, *, speculative: bool = True, temperature: float = 0.0, seed: int = 0,
                 drafter=None, slots: Iterable[int] | None = None, prefix_cache=None, top_p: float = 1.0,
                 adaptive: bool = False):
        """Serve requests over `slots` of `session` (default: all of them).

        speculative: draft and verify up to draft_width + 1 tokens per step; otherwise one.
        temperature: 0 decodes greedily; above 0 samples, speculatively with residual
            resampling, from a per-request generator seeded from `seed` and the request's
            submission index (or the request's own seed). A request may set its own.
        top_p: nucleus sampling mass for requests that set none, applied to the target's and
            the draft's distributions alike (speculative sampling stays exact).
        drafter: `drafter(rows) -> one list of draft_width token ids per row`, replacing
            the draft pass; its drafts count as deterministic (q one-hot) when sampling.
        prefix_cache: a `prefix_cache.PrefixCache`; prefill hydrates the longest stored
            prefix of each prompt and prefills only the rest, storing snapshots at the
            cache's boundaries. Requests of one prompt (an API request's n samples) are then
            prefilled once: the others wait for the next prefill batch, which restores the
            first one's snapshot and shares its pages.
        adaptive: greedy rows of a drafting engine decode through the decode pass while drafting
            does not pay for them, and probe again later (draft_policy.py); needs the decode pass
            in the session. Otherwise every row drafts every step.
        """
        if not (isinstance(temperature, (int, float)) and temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
        self.session, self.speculative, self.drafter, self.prefix_cache = session, speculative, drafter, prefix_cache
        self.sampling = Sampling(float(temperature), float(top_p), seed)
        package = session.package
        self.vocab_size = package.vocab_size
        self.max_seq_len = package.manifest.model.max_seq_len
        self.verify_width = package.passes["verify"].width
        self.draft_width = package.passes["draft"].width
        self.passes = passes_used(session.buckets, speculative, drafter, adaptive)
        missing = [p for p in self.passes if p not in session.buckets]
        if missing:
            raise ValueError(f"the session has no {', '.join(missing)} pass; this engine replays "
                             f"{', '.join(self.passes)}")
        # Without speculation, one token per row per step: through the decode pass where the
        # package has one (nothing but that token's rows), else verify + commit of one row.
        decode_pass = "decode" if not speculative and "decode" in session.buckets else None
        # A group must fit one bucket of every pass it replays.
        decode_rows = max(session.buckets["decode"]) if decode_pass else \
            min((max(session.buckets[p]) for p in DECODE_PASSES + ("decode",) if p in self.passes), default=None)
        prefill_rows = max(session.buckets["prefill"])
        self.slots = check_slots(session, slots)
        self.scheduler = Scheduler(session, self.slots, self.sampling, prefix_cache, self.verify_width,
                                   prefill_rows, decode_rows, decode_rows if decode_pass else prefill_rows)
        policy = DraftPolicy(lambda mode, rows: session.bucket_for(mode, rows).rows) \
            if "decode" in self.passes and speculative else None
        self.executor = Executor(session, self.slots, self.scheduler.span, speculative=speculative, drafter=drafter,
                                 prefix_cache=prefix_cache, decode_pass=decode_pass, policy=policy)
        self.stats = EngineStats()
        self.last_step: StepStats | None = None
        self._step_calls = 0

    def configuration(self) -> dict:
        """What this engine was built with, as plain data (the same options give the same data)."""
        cache = self.prefix_cache
        return {"device": str(self.session.device), "slots": len(self.slots), "passes": list(self.passes),
                "compiled_passes": [p for p in self.passes if p in getattr(self.session, "compiled_passes", ())],
                "speculative": self.speculative, "adaptive": self.executor.policy is not None,
                "temperature": self.sampling.temperature,
                "top_p": self.sampling.top_p, "seed": self.sampling.seed,
                "pages": {name: s.pages for name, s in self.session.pages.pool_stats().items()},
                "prefix_cache": None if cache is None else cache.configuration()}

    # The scheduler's queues, for callers that watch them.
    waiting = property(lambda self: self.scheduler.waiting)
    active = property(lambda self: self.scheduler.active)
    finished = property(lambda self: self.scheduler.finished)
    free = property(lambda self: self.scheduler.free)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    # -- requests -----------------------------------------------------------------------

    def submit(self, requests: Iterable[Request | list[int]]) -> list[RequestState]:
        """Queue requests; every one is checked first, so a bad one queues none of them."""
        states = self.scheduler.new_states(requests)
        self.waiting.extend(states)
        return states

    def new_states(self, requests: Iterable[Request | list[int]], check_pages: bool = True) -> list[RequestState]:
        """Check requests and make their states (scheduler.py); nothing is queued."""
        return self.scheduler.new_states(requests, check_pages)

    def span(self, request) -> int:
        return self.scheduler.span(request)

    def cancel(self, request_id) -> RequestState | None:
        """End a waiting or running request now (finish_reason "cancelled"); its slot and pages
        return at once. Call between steps. None when no such request is waiting or running."""
        return self.scheduler.cancel(request_id, StepStats())

    def generate(self, requests: Iterable[Request | list[int]], on_step=None) -> list[RequestState]:
        """Serve `requests` to completion; returns their states in the order given."""
        states = self.submit(requests)
        self.run(on_step)
        return states

    def run(self, on_step=None) -> None:
        """Step until every submitted request is finished; `on_step(step_stats)` after each step."""
        while self.busy:
            step = self.step()
            if on_step is not None:
                on_step(step)

    # -- one step -----------------------------------------------------------------------

    def step(self) -> StepStats:
        """Admit into free slots, decode every active request once, retire, refill freed slots."""
        stats = StepStats(step=self._step_calls)
        self._step_calls += 1
        self.swap_in_compiled()
        self._admit(stats)
        self.scheduler.check_progress(stats)
        if self.active:
            start = time.perf_counter()
            self.executor.decode(self.scheduler.decode_plan(), stats)
            stats.decode_seconds = time.perf_counter() - start
            self.scheduler.retire_done(stats)
            self._admit(stats)
        self.stats.record(stats)
        self.last_step = stats
        return stats

    def swap_in_compiled(self) -> bool:
        """Replay compiled graphs from now on if the session's background compilation has finished
        (session/background_compile.py); only while no request is in flight, so every request's
        tokens come from one kind of replay. True when this call switched."""
        return not self.active and self.session.swap_in_compiled()

    def _admit(self, stats: StepStats) -> None:
        for batch in self.scheduler.admissions(stats):
            start = time.perf_counter()
            deferred = self.executor.prefill_batch(batch, stats)
            stats.prefill_seconds += time.perf_counter() - start
            self.scheduler.settle(batch, deferred, stats)

    # Rows driven by hand (speculative.py's Decoder) run through the executor directly.
    def prefill_batch(self, batch: list[RequestState], stats: StepStats, reserve: bool = True) -> list[RequestState]:
        return self.executor.prefill_batch(batch, stats, reserve)

    def decode_group(self, rows: list[RequestState], stats: StepStats) -> None:
        self.executor.decode_group(rows, stats)
