"""The engine's scheduler: which request runs where and when, never a replay.

It checks and numbers submitted requests, keeps them waiting until a slot and every page
they may need can be had (prefix snapshots no request holds give their pages back first),
hands out admission batches, groups the running requests for a step (`DecodePlan`), and
retires finished ones, whose slots and pages return at once. The executor (executor.py)
replays what it plans.

Pages: a request is admitted only when the session can reserve every page it may ever
need (prompt, new tokens and one verify block, up to max_seq_len; pages shared from a
prefix hit are not counted twice). Otherwise it waits at the head of the queue until a
retiring request frees pages. A request that could not fit even in an empty session is
refused when submitted, before anything runs.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from b12x_toolchain.runtime.errors import PagesExhausted
from b12x_toolchain.runtime.serving.requests import GREEDY_BELOW, Request, RequestState, check_request
from b12x_toolchain.runtime.serving.stats import StepStats


@dataclass(frozen=True)
class Sampling:
    """What a request that sets none of its own samples with."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class DecodePlan:
    """One step's decoding: groups of running rows, each fitting one bucket of its passes.
    `tail` rows are too close to max_seq_len for a verify block and go one token at a time."""

    groups: list[list[RequestState]]
    tail: list[list[RequestState]]


class Scheduler:
    def __init__(self, session, slots: list[int], sampling: Sampling, prefix_cache, verify_width: int,
                 prefill_rows: int, decode_rows: int | None, tail_rows: int):
        self.session, self.slots, self.sampling, self.prefix_cache = session, slots, sampling, prefix_cache
        model = session.package.manifest.model
        self.vocab_size, self.max_seq_len = session.package.vocab_size, model.max_seq_len
        self.verify_width, self.prefill_rows = verify_width, prefill_rows
        self.decode_rows, self.tail_rows = decode_rows, tail_rows
        self.free = deque(slots)
        self.waiting: deque[RequestState] = deque()
        self.active: list[RequestState] = []
        self.finished: list[RequestState] = []
        self._held: set[int] = set()  # slots some request of this engine has held
        self._ids: set = set()
        self._submitted = 0
        self._blocked = False

    # -- requests -----------------------------------------------------------------------

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
        return [self._state(request, label) for request, label in zip(items, labels)]

    def _state(self, request: Request, label) -> RequestState:
        index = self._submitted
        self._submitted += 1
        self._ids.add(label)
        seed = ("request", request.seed) if request.seed is not None else ("engine", self.sampling.seed, index)
        temperature = self.sampling.temperature if request.temperature is None else float(request.temperature)
        return RequestState(label, list(request.prompt), request.max_new_tokens, frozenset(request.stop),
                            _generator(seed), submitted_at=time.perf_counter(),
                            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                            top_p=self.sampling.top_p if request.top_p is None else float(request.top_p),
                            min_tokens=request.min_tokens, logprobs=request.logprobs,
                            prompt_logprobs=request.prompt_logprobs)

    def span(self, request) -> int:
        """The most tokens a request's slot may hold: commit can run a verify block past its last token."""
        return min(len(request.prompt) + request.max_new_tokens + self.verify_width, self.max_seq_len)

    def cancel(self, request_id, stats: StepStats) -> RequestState | None:
        """End a waiting or running request now (finish_reason "cancelled"); its slot and pages
        return at once. None when no such request is waiting or running."""
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
                self.retire(request, stats)
                return request
        return None

    # -- admission ----------------------------------------------------------------------

    def admissions(self, stats: StepStats) -> Iterator[list[RequestState]]:
        """Batches of waiting requests, each given a slot and its pages, to prefill together;
        the caller prefills each and hands it back through `settle` before asking for the next.
        First come, first served: a request whose pages cannot be had stops the round."""
        self._blocked = False
        while self.waiting and self.free and not self._blocked:
            batch = self._take_batch(stats)
            if not batch:
                return
            yield batch

    def _take_batch(self, stats: StepStats) -> list[RequestState]:
        batch, relied = [], []
        while self.waiting and self.free and len(batch) < self.prefill_rows:
            head = self.waiting[0]
            if restores(self.prefix_cache, head) and any(r.prompt == head.prompt for r in batch):
                break  # a sibling (n > 1): next batch, where it restores this one's snapshot and shares its pages
            if not self._reserve(head, self.free[0], relied):
                stats.page_waits += 1
                self._blocked = True
                break
            request, slot = self.waiting.popleft(), self.free.popleft()
            stats.slot_reuse += slot in self._held
            self._held.add(slot)
            request.slot = slot
            batch.append(request)
        return batch

    def _reserve(self, request, slot: int, relied: list) -> bool:
        """Reserve the pages `request` may need in `slot`, after the prefix cache gave back what it
        can. Full pages of the L1 snapshot it will hydrate are shared, not needed anew, and that
        snapshot (like every one this admission round relies on, `relied`) is never given back."""
        pages, span, cache = self.session.pages, self.span(request), self.prefix_cache
        hit = cache.shared_prefix(request.prompt) if restores(cache, request) else None
        shared = hit.length if hit is not None and hit.pages.tables is pages else 0
        relied.extend([hit] if shared else [])
        if not pages.can_reserve(slot, 0, span, shared) and cache is not None:
            cache.release_pages(lambda: pages.can_reserve(slot, 0, span, shared), keep=relied)
        if not pages.can_reserve(slot, 0, span, shared):
            return False
        pages.reserve(slot, 0, span, shared)
        return True

    def settle(self, batch: list[RequestState], deferred: list[RequestState], stats: StepStats) -> None:
        """After a batch's prefill: rows whose pages could not be had after all wait again at the
        head of the queue (and stop this round); the rest run, or retire if their first token ended them."""
        for request in reversed(deferred):
            batch.remove(request)
            self.session.retire_slot(request.slot)
            self.free.appendleft(request.slot)
            self.waiting.appendleft(request)
            self._blocked = True
        stats.admitted += len(batch)
        for request in batch:
            if request.done:
                self.retire(request, stats)
            else:
                self.active.append(request)

    def check_progress(self, stats: StepStats) -> None:
        """A head request that waits for pages while nothing runs would wait forever (never_fits
        was checked at submission, so this is a pages bookkeeping failure, said as such)."""
        if self.waiting and not self.active and not stats.admitted:
            pools = {name: pool.in_use for name, pool in self.session.pages.pool_stats().items()}
            raise PagesExhausted(f"request {self.waiting[0].id!r} waits for pages although no request runs; "
                                 f"pages in use per pool: {pools}")

    # -- decoding and retiring ----------------------------------------------------------

    def decode_plan(self) -> DecodePlan:
        """Verify writes verify_width positions ahead; the last few tokens before max_seq_len are
        decoded one at a time instead."""
        tail = [r for r in self.active if r.length + self.verify_width > self.max_seq_len]
        body = [r for r in self.active if r.length + self.verify_width <= self.max_seq_len]
        return DecodePlan(_groups(body, self.decode_rows), _groups(tail, self.tail_rows))

    def retire_done(self, stats: StepStats) -> None:
        for request in [r for r in self.active if r.done]:
            self.retire(request, stats)
        self.active = [r for r in self.active if not r.done]

    def retire(self, request: RequestState, stats: StepStats) -> None:
        request.finished_at = time.perf_counter()
        self.session.retire_slot(request.slot)  # its pages and reservation go back at once
        self.free.append(request.slot)
        self.finished.append(request)
        stats.retired += 1


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
    check_slot_ids(slots, slots)
    return slots


def check_slot_ids(slot_ids: list[int], allowed: list[int]) -> None:
    """A group's slot ids, checked before its first replay so a step runs all its passes or none."""
    seen = set()
    for slot in slot_ids:
        if slot in seen:
            raise ValueError(f"slot id {slot} appears twice in {slot_ids}; each row needs its own slot")
        if slot not in allowed:
            raise ValueError(f"slot id {slot} is not one of this engine's slots {sorted(allowed)}")
        seen.add(slot)


def restores(cache, request: RequestState) -> bool:
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
