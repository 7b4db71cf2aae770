"""The serving loop: many requests over the reused slots of one session.

A step decodes every active request together — draft, verify, accept, commit — in
groups of at most the largest rows bucket; the session pads each group up to its
nearest bucket with rows that point at the scratch slot, so padding never touches a
live slot. The step then retires the requests that finished (max_new_tokens or a stop
token) and admits waiting requests into the freed slots at once: their prompts are
prefilled together, chunk by chunk, and the last prompt position's logits give each
its first token.

A slot changes hands by resetting its committed length. Row ids and positions are graph
inputs and every cache read is masked by position, so the previous request's rows are
invisible to the next one and no graph is captured again.

Pages: a request is admitted only when the session can reserve every page it may ever
need (prompt, new tokens and one verify block, up to max_seq_len; pages shared from a
prefix hit are not counted twice). Otherwise it waits at the head of the queue — after
the prefix cache has given back the pages of snapshots no request holds — until a
retiring request frees pages. A request that could not fit even in an empty session is
refused when submitted, before anything runs. A retiring request's pages return at once.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Iterable

import torch

from b12x_toolchain.runtime.errors import PagesExhausted
from b12x_toolchain.runtime.serving.drafts import Drafts, device_drafts
from b12x_toolchain.runtime.serving.logprobs import token_logprobs
from b12x_toolchain.runtime.serving.requests import GREEDY_BELOW, Request, RequestState, check_request
from b12x_toolchain.runtime.serving.sampling import accept_greedy, accept_sampled, draw, probabilities, top_two_gap
from b12x_toolchain.runtime.serving.stats import EngineStats, StepStats
from b12x_toolchain.runtime.session.transfers import download, to_device

DECODE_PASSES = ("draft", "verify", "commit")


def passes_used(package_passes, speculative: bool = True, drafter=None) -> tuple[str, ...]:
    """The passes an engine replays: prefill, then decode for plain decoding where the package
    has it, else verify and commit, with draft when speculating without a drafter of its own.
    A session of just these deserialises no other graph."""
    if not speculative and "decode" in package_passes:
        return "prefill", "decode"
    return ("prefill", "verify", "commit") + (("draft",) if speculative and drafter is None else ())


class Engine:
    def __init__(self, session, *, speculative: bool = True, temperature: float = 0.0, seed: int = 0,
                 drafter=None, slots: Iterable[int] | None = None, prefix_cache=None, top_p: float = 1.0):
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
        """
        if not (isinstance(temperature, (int, float)) and temperature >= 0):
            raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
        self.top_p = float(top_p)
        self.session, self.speculative, self.temperature = session, speculative, float(temperature)
        self.seed, self.drafter, self.prefix_cache = seed, drafter, prefix_cache
        package = session.package
        self.vocab_size = package.vocab_size
        self.max_seq_len = package.manifest.model.max_seq_len
        self.noise = package.manifest.model.noise_token_id
        self.verify_width = package.passes["verify"].width
        self.draft_width = package.passes["draft"].width
        self.chunk = package.passes["prefill"].width
        used = passes_used(session.buckets, speculative, drafter)
        missing = [p for p in used if p not in session.buckets]
        if missing:
            raise ValueError(f"the session has no {', '.join(missing)} pass; this engine replays {', '.join(used)}")
        # A group must fit one bucket of every pass it replays.
        self.decode_rows = min((max(session.buckets[p]) for p in DECODE_PASSES if p in used), default=None)
        self.prefill_rows = max(session.buckets["prefill"])
        # Without speculation, one token per row per step: through the decode pass where the
        # package has one (nothing but that token's rows), else verify + commit of one row.
        self.decode_pass = "decode" if not speculative and "decode" in session.buckets else None
        if self.decode_pass:
            self.decode_rows = max(session.buckets["decode"])
        self.slots = check_slots(session, slots)
        self.free = deque(self.slots)
        self.waiting: deque[RequestState] = deque()
        self.active: list[RequestState] = []
        self.finished: list[RequestState] = []
        self.stats = EngineStats()
        self.last_step: dict = {}
        self._held: set[int] = set()  # slots some request of this engine has held
        self._ids: set = set()
        self._submitted = 0
        self._step_calls = 0

    # -- requests -----------------------------------------------------------------------

    def submit(self, requests: Iterable[Request | list[int]]) -> list[RequestState]:
        """Queue requests; every one is checked first, so a bad one queues none of them."""
        states = self.new_states(requests)
        self.waiting.extend(states)
        return states

    def new_states(self, requests: Iterable[Request | list[int]], check_pages: bool = True) -> list[RequestState]:
        """Check requests and make their states, numbered in submission order; nothing is queued.

        check_pages: refuse a request whose pages could never be had (rows driven by hand,
        which reserve nothing and grow as they go, skip it)."""
        items = [r if isinstance(r, Request) else Request(prompt=r) for r in requests]
        labels = []
        for offset, request in enumerate(items):
            label = request.id if request.id is not None else self._submitted + offset
            check_request(request, repr(label), self.vocab_size, self.max_seq_len)
            reason = self.session.pages.never_fits(self.span(request)) if check_pages else None
            if reason is not None:
                raise ValueError(f"request {label!r} can never fit this session: {reason}")
            if label in self._ids or label in labels:
                raise ValueError(f"request {label!r}: id is used twice; request ids must be unique")
            labels.append(label)
        states = []
        now = time.perf_counter()
        for request, label in zip(items, labels):
            index = self._submitted
            self._submitted += 1
            self._ids.add(label)
            seed = ("request", request.seed) if request.seed is not None else ("engine", self.seed, index)
            temperature = self.temperature if request.temperature is None else float(request.temperature)
            state = RequestState(label, list(request.prompt), request.max_new_tokens, frozenset(request.stop),
                                 _generator(seed), submitted_at=now,
                                 temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                                 top_p=self.top_p if request.top_p is None else float(request.top_p),
                                 min_tokens=request.min_tokens, logprobs=request.logprobs,
                                 prompt_logprobs=request.prompt_logprobs)
            states.append(state)
        return states

    def span(self, request) -> int:
        """The most tokens a request's slot may hold: commit can run a verify block past its last token."""
        return min(len(request.prompt) + request.max_new_tokens + self.verify_width, self.max_seq_len)

    def _pages_for(self, request, slot: int, relied: list) -> bool:
        """Reserve the pages `request` may need in `slot`, after the prefix cache gave back what it
        can. Full pages of the L1 snapshot it will hydrate are shared, not needed anew, and that
        snapshot (like every one this admission round relies on, `relied`) is never given back."""
        pages, span = self.session.pages, self.span(request)
        hit = self.prefix_cache.shared_prefix(request.prompt) if _restores(self.prefix_cache, request) else None
        shared = hit.length if hit is not None and hit.pages.tables is pages else 0
        relied.extend([hit] if shared else [])
        if not pages.can_reserve(slot, 0, span, shared) and self.prefix_cache is not None:
            self.prefix_cache.release_pages(lambda: pages.can_reserve(slot, 0, span, shared), keep=relied)
        if not pages.can_reserve(slot, 0, span, shared):
            return False
        pages.reserve(slot, 0, span, shared)
        return True

    def cancel(self, request_id) -> RequestState | None:
        """End a waiting or running request now (finish_reason "cancelled"); its slot and pages
        return at once. Call between steps. None when no such request is waiting or running."""
        for request in self.waiting:
            if request.id == request_id:
                self.waiting.remove(request)
                request.finish_reason, request.finished_at = "cancelled", time.perf_counter()
                self.finished.append(request)
                return request
        for request in self.active:
            if request.id == request_id:
                self.active.remove(request)
                request.finish_reason = "cancelled"
                self._retire(request, StepStats())
                return request
        return None

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    def generate(self, requests: Iterable[Request | list[int]], on_step=None) -> list[RequestState]:
        """Serve `requests` to completion; returns their states in the order given."""
        states = self.submit(requests)
        self.run(on_step)
        return states

    def run(self, on_step=None) -> None:
        """Step until every submitted request is finished; `on_step(step_dict)` after each step."""
        while self.busy:
            step = self.step()
            if on_step is not None:
                on_step(step)

    # -- one step -----------------------------------------------------------------------

    def step(self) -> dict:
        """Admit into free slots, decode every active request once, retire, refill freed slots."""
        stats = StepStats(step=self._step_calls)
        self._step_calls += 1
        self._admit(stats)
        if self.waiting and not self.active and not stats.admitted:  # never_fits was checked at submission
            raise PagesExhausted(f"request {self.waiting[0].id!r} waits for pages although no request runs: "
                                 f"{self.session.pages.stats()['pools']}")
        if self.active:
            start = time.perf_counter()
            # Verify writes verify_width positions ahead; the last few tokens before
            # max_seq_len are decoded one at a time through prefill instead.
            tail = [r for r in self.active if r.length + self.verify_width > self.max_seq_len]
            body = [r for r in self.active if r.length + self.verify_width <= self.max_seq_len]
            for group in _groups(body, self.decode_rows):
                self.decode_group(group, stats)
            for group in _groups(tail, self.decode_rows if self.decode_pass else self.prefill_rows):
                self._decode_one(group, stats)
            stats.decode_seconds = time.perf_counter() - start
            for request in [r for r in self.active if r.done]:
                self._retire(request, stats)
            self.active = [r for r in self.active if not r.done]
            self._admit(stats)
        self.stats.record(stats)
        self.last_step = stats.as_dict()
        return self.last_step

    def _admit(self, stats: StepStats) -> None:
        blocked = False
        while self.waiting and self.free and not blocked:
            batch, relied = [], []
            while self.waiting and self.free and len(batch) < self.prefill_rows:
                if _restores(self.prefix_cache, self.waiting[0]) and \
                        any(r.prompt == self.waiting[0].prompt for r in batch):
                    break  # a sibling (n > 1): next batch, where it restores this one's snapshot and shares its pages
                if not self._pages_for(self.waiting[0], self.free[0], relied):
                    stats.page_waits += 1
                    blocked = True  # first come, first served: later requests wait behind it
                    break
                request, slot = self.waiting.popleft(), self.free.popleft()
                stats.slot_reuse += slot in self._held
                self._held.add(slot)
                request.slot = slot
                batch.append(request)
            if not batch:
                break
            start = time.perf_counter()
            deferred = self.prefill_batch(batch, stats)
            stats.prefill_seconds += time.perf_counter() - start
            for request in reversed(deferred):  # their pages could not be had after all: queued again
                batch.remove(request)
                self.session.retire_slot(request.slot)
                self.free.appendleft(request.slot)
                self.waiting.appendleft(request)
                blocked = True
            stats.admitted += len(batch)
            for request in batch:
                if request.done:  # its first token already ended it: the slot is free again
                    self._retire(request, stats)
                else:
                    self.active.append(request)

    def _retire(self, request: RequestState, stats: StepStats) -> None:
        request.finished_at = time.perf_counter()
        self.session.retire_slot(request.slot)  # its pages and reservation go back at once
        self.free.append(request.slot)
        self.finished.append(request)
        stats.retired += 1

    # -- passes -------------------------------------------------------------------------

    def _replay(self, pass_name: str, stats: StepStats, **values) -> dict:
        rows = len(values["slot_ids"])
        stats.padding_rows += self.session.bucket_for(pass_name, rows).rows - rows
        return self.session.replay(pass_name, **values)

    def prefill_batch(self, batch: list[RequestState], stats: StepStats, reserve: bool = True) -> list[RequestState]:
        """Prefill every prompt of the batch, chunk by chunk, the rows of one chunk together.

        With a prefix cache each row first hydrates its longest stored prefix, so rows
        start at different positions; each chunk continues every row from its own length.
        reserve: keep each row's page reservation (made at admission) to what it still
        needs; rows whose pages cannot be had are left out and returned. Rows driven by
        hand reserve nothing and grow as they go.
        """
        cache, last, deferred = self.prefix_cache, {}, []
        for request in batch:
            self.session.reset_slot(request.slot)
            request.length = 0
            hit = cache.restore(self.session, request.slot, request.prompt) if _restores(cache, request) else None
            # What the slot still needs now that its shared pages are known. Admission reserved for
            # the hit it expected; a different one (from L2, copied) may need more than can be had.
            committed, span = hit.length if hit else 0, self.span(request)
            if reserve and not self.session.pages.can_reserve(request.slot, committed, span):
                deferred.append(request)
                continue
            if reserve:
                self.session.pages.reserve(request.slot, committed, span)
            request.cached_tokens, request.prefix_tier = (hit.length, hit.tier) if hit else (0, None)
            if hit is not None:
                request.length = hit.length
                if hit.length == len(request.prompt):  # exact hit: the stored logits give the first token
                    last[request.slot] = hit.snapshot.logits
        batch = [r for r in batch if r not in deferred]
        while rows := [r for r in batch if r.length < len(r.prompt)]:
            pieces = [r.prompt[r.length : r.length + self.chunk] for r in rows]
            out = self._replay("prefill", stats, token_ids=[p + [0] * (self.chunk - len(p)) for p in pieces],
                               slot_ids=[r.slot for r in rows], positions=[r.length for r in rows],
                               new_tokens=[len(p) for p in pieces])
            for i, (request, piece) in enumerate(zip(rows, pieces)):
                if request.prompt_logprobs is not None:  # what each position predicts of the next prompt token
                    following = request.prompt[request.length + 1 : request.length + 1 + len(piece)]
                    request.prompt_token_logprobs += token_logprobs(download({}, {"logits": out["logits"][i]})[
                        "logits"], following, request.prompt_logprobs)
                request.length += len(piece)
                logits = out["logits"][i, len(piece) - 1].clone()  # the next replay reuses out
                if request.length == len(request.prompt):
                    last[request.slot] = logits
                if cache is not None and cache.boundary(request.length, len(request.prompt)):
                    cache.store(self.session, request.slot, request.prompt[: request.length], logits)
        if not batch:
            return deferred
        device = self.session.device
        firsts = self._choose(batch, torch.stack([last[r.slot].to(device) for r in batch]))
        now = time.perf_counter()
        for request, (token, gap, logprobs) in zip(batch, firsts):
            request.pending = token
            request.first_token_at = now
            if not request.done:  # a request that failed choosing emits nothing
                self._emit(request, [token], [gap], stats, logprobs)
            stats.prefill_tokens += len(request.prompt)
        return deferred

    def _choose(self, rows: list[RequestState], logits: torch.Tensor) -> list[tuple[int, float]]:
        """(token, margin) per row from logits [rows, vocab] on the device, in one transfer:
        greedy rows take the argmax, sampled rows draw from their logits, fetched with it."""
        fetched = _host_rows(rows)
        host = _fetch(logits, fetched)
        out = []
        for i, request in enumerate(rows):
            row = host["logits"][fetched.index(i)].unsqueeze(0) if i in fetched else None

            def choose(request=request, row=row, target=host["targets"][i]):
                token = draw(probabilities(row[0], request.temperature, request.top_p), request.generator) \
                    if request.temperature > 0 else target
                return [token], _logprobs(request, row, [token])

            emitted, logprobs = _isolated(request, choose, [host["targets"][i]])
            out.append((emitted[0], host["margins"][i], logprobs))
        return out

    def _drafts(self, rows: list[RequestState], stats: StepStats) -> Drafts:
        """Each row's drafts and verify's block: noise without speculation, the drafter's on the
        host, or the draft pass's, left on the device (drafts.py)."""
        if not self.speculative or self.drafter is not None:
            drafts = self._external_drafts(rows) if self.speculative else [[] for _ in rows]
            block = [([r.pending] + d + [self.noise] * self.draft_width)[: self.draft_width + 1]
                     for r, d in zip(rows, drafts)]
            return Drafts(block=block, host=drafts)
        block = [[r.pending] + [self.noise] * (self.draft_width - 1) for r in rows]
        out = self._replay("draft", stats, token_ids=block, slot_ids=[r.slot for r in rows],
                           positions=[r.length for r in rows])
        sampled = [(i, r.temperature, r.top_p, r.generator) for i, r in enumerate(rows) if r.temperature > 0]
        return device_drafts(out, self.session.package.manifest, [r.pending for r in rows], self.noise, sampled)

    def _external_drafts(self, rows: list[RequestState]) -> list[list[int]]:
        drafts = [list(d) for d in self.drafter(rows)]
        if len(drafts) != len(rows):
            raise ValueError(f"drafter returned {len(drafts)} draft lists for {len(rows)} rows")
        for request, draft in zip(rows, drafts):
            if len(draft) != self.draft_width or not all(
                    isinstance(t, int) and 0 <= t < self.vocab_size for t in draft):
                raise ValueError(f"drafter: request {request.id!r}: expected {self.draft_width} token ids in "
                                 f"[0, {self.vocab_size}), got {draft}")
        return drafts

    def decode_group(self, rows: list[RequestState], stats: StepStats) -> None:
        """draft -> verify -> accept -> commit for one group of rows (one decode replay without
        speculation). The draft pass's drafts stay on the device; after verify, one transfer
        brings the target's picks, margins and (for sampled rows) distributions to the host,
        which accepts and commits."""
        if self.decode_pass:
            return self._decode_one(rows, stats)
        slots, positions = [r.slot for r in rows], [r.length for r in rows]
        check_rows(slots, self.slots)
        drafts = self._drafts(rows, stats)
        # A block ended early (low draft confidence) is padded; acceptance stops at its end.
        logits = self._replay("verify", stats, token_ids=drafts.block, slot_ids=slots, positions=positions)["logits"]
        fetched = _host_rows(rows)
        host = _fetch(logits, fetched, drafts)
        sampled = [i for i, r in enumerate(rows) if r.temperature > 0]  # q's rows, in order
        results = []
        for i, request in enumerate(rows):
            draft = drafts.host[i] if drafts.host is not None else host["draft_ids"][i][: host["drafts_kept"][i]]
            row = host["logits"][fetched.index(i)] if i in fetched else None
            q = host["q"][sampled.index(i)] if "q" in host and request.temperature > 0 else None

            def accept(request=request, draft=draft, targets=host["targets"][i], row=row, q=q):
                if request.temperature == 0:
                    emitted = accept_greedy(draft, targets) if self.speculative else targets[:1]
                else:
                    p = probabilities(row, request.temperature, request.top_p)
                    emitted = accept_sampled(draft, q, p, request.generator) if self.speculative \
                        else [draw(p[0], request.generator)]
                return emitted, _logprobs(request, row, emitted)

            emitted, logprobs = _isolated(request, accept, host["targets"][i][:1])
            accepted = len(emitted) - 1
            stats.drafted += len(draft)
            stats.accepted += accepted
            stats.accepted_lengths.append(accepted)
            request.accepted += accepted
            results.append((emitted, host["margins"][i][: len(emitted)], logprobs))
        # Commit pending plus the accepted drafts; the last emitted token becomes pending.
        self._replay("commit", stats, slot_ids=slots, positions=positions,
                     accepted_tokens=[len(emitted) for emitted, _, _ in results])
        for request, (emitted, margins, logprobs) in zip(rows, results):
            request.length += len(emitted)
            self._finish_step(request, emitted, margins, stats, logprobs)

    def _decode_one(self, rows: list[RequestState], stats: StepStats) -> None:
        """One token per row through decode (or prefill), which writes the pending token's rows directly."""
        slots = [r.slot for r in rows]
        check_rows(slots, self.slots)
        name = self.decode_pass or "prefill"
        width = self.session.package.passes[name].width
        out = self._replay(name, stats, token_ids=[[r.pending] + [0] * (width - 1) for r in rows],
                           slot_ids=slots, positions=[r.length for r in rows], new_tokens=[1] * len(rows))
        for request, (token, gap, logprobs) in zip(rows, self._choose(rows, out["logits"][:, 0])):
            request.length += 1
            self._finish_step(request, [token], [gap], stats, logprobs)

    def _finish_step(self, request: RequestState, emitted: list[int], margins: list[float], stats: StepStats,
                     logprobs=None) -> None:
        request.pending = emitted[-1]
        request.steps += 1
        stats.rows += 1
        stats.bonus += 1
        if not request.done:  # a request that failed this step emits nothing
            self._emit(request, emitted, margins, stats, logprobs)

    def _emit(self, request: RequestState, tokens: list[int], margins: list[float], stats: StepStats,
              logprobs=None) -> None:
        before = len(request.tokens)
        request.emit(tokens, margins, logprobs)
        stats.generated += len(request.tokens) - before


def check_slots(session, slots: Iterable[int] | None) -> list[int]:
    """The slots an engine may use: in range, not the scratch slot, each once."""
    if slots is None:
        return list(range(session.slots))
    slots = list(slots)
    if not slots:
        raise ValueError("slots is empty; an engine needs at least one slot")
    for slot in slots:
        if not isinstance(slot, int) or isinstance(slot, bool):
            raise ValueError(f"slot {slot!r} is not an integer slot id")
        if slot == session.scratch_slot:
            raise ValueError(f"slot {slot} is the session's scratch slot, which padding rows use; "
                             f"requests get slots in [0, {session.slots})")
        if not 0 <= slot < session.slots:
            raise ValueError(f"slot {slot} is out of range; the session has slots [0, {session.slots})")
    check_rows(slots, slots)
    return slots


def check_rows(row_ids: list[int], allowed: list[int]) -> None:
    """A group's row ids, checked before its first replay so a step runs all its passes or none."""
    seen = set()
    for row in row_ids:
        if row in seen:
            raise ValueError(f"row id {row} appears twice in {row_ids}; each row needs its own slot")
        if row not in allowed:
            raise ValueError(f"row id {row} is not one of this engine's slots {sorted(allowed)}")
        seen.add(row)


def _fetch(logits: torch.Tensor, fetched: list[int], drafts: Drafts | None = None) -> dict:
    """What the host needs of a pass's logits [rows, ..., vocab], in one transfer: the argmax
    and the margin at each position, the drafts a draft pass left on the device and how many
    of each row count, the logits of the `fetched` rows (sampled, or asking for logprobs), and
    the draft distributions the sampled rows drew from."""
    lists = {"targets": logits.argmax(-1), "margins": top_two_gap(logits)}
    if drafts is not None and drafts.ids is not None:
        lists |= {"draft_ids": drafts.ids, "drafts_kept": drafts.kept}
    tensors = {}
    if fetched:
        tensors["logits"] = logits.index_select(0, to_device(fetched, torch.int64, logits.device))
    if drafts is not None and drafts.q is not None:
        tensors["q"] = drafts.q
    return download(lists, tensors)


def _host_rows(rows: list[RequestState]) -> list[int]:
    """The rows whose logits the host reads: sampled ones, and those asking for logprobs."""
    return [i for i, r in enumerate(rows) if r.temperature > 0 or r.logprobs is not None]


def _logprobs(request: RequestState, logits: torch.Tensor | None, emitted: list[int]):
    return None if request.logprobs is None else token_logprobs(logits, emitted, request.logprobs)


def _isolated(request: RequestState, decide, fallback: list[int]):
    """decide() for one request; an error in it (a distribution the sampler cannot draw from)
    fails that request alone: it emits nothing more, its slot commits `fallback` and retires."""
    try:
        return decide()
    except (RuntimeError, ValueError, ArithmeticError) as exc:
        request.finish_reason, request.error = "error", f"{type(exc).__name__}: {exc}"
        return fallback, None


def _restores(cache, request: RequestState) -> bool:
    """Whether a prompt starts from a prefix snapshot: not when its prompt logprobs are asked,
    which need every position prefilled."""
    return cache is not None and request.prompt_logprobs is None


def _generator(key: tuple) -> torch.Generator:
    # torch's CPU generator keeps only the low 32 bits of a seed: hash the key into them,
    # so seeds that differ only in high bits, or by the request index, still differ.
    digest = hashlib.blake2b(repr(key).encode(), digest_size=4).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def _groups(rows: list, size: int) -> list[list]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]
