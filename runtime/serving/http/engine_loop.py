"""One engine, one thread, every connection: continuous batching behind the HTTP handlers.

The loop thread builds the engine (`start`: its session is prepared, and its CUDA graphs
captured, on this thread) and is then the only thread that touches it: a CUDA graph, the
current device and the current stream are per thread, so graphs are replayed on the
thread that captured them. What building raises is raised by `start`, in its caller.

Handlers hand requests to the loop (`submit`: the choices of one HTTP request, all or
none) and read what it sends back from their `Ticket`s, which share one queue. Between two `engine.step()` calls the loop queues new requests, cancels those
whose client went away (their slot and pages return before the next step), then steps and
hands every request its new tokens. So requests join and leave the running batch at every
step.

The queue is bounded: when `max_queue` requests already wait for a slot, `submit`
refuses with 503 and Retry-After (0 admits only requests that find a free slot). `drain()` stops admitting (503); `stop()` cancels what
still runs and ends the thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import Callable

from b12x_toolchain.runtime.serving.http.errors import APIError
from b12x_toolchain.runtime.serving.ranks import between_steps
from b12x_toolchain.runtime.serving.requests import Request, RequestState, TokenLogprob

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class Update:
    """What a request got since the last update; finish_reason is set on its last one."""

    tokens: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # every token generated so far (a hidden stop token included)
    cached_tokens: int = 0
    error: APIError | None = None
    index: int = 0  # the choice this update belongs to
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens`, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # on a request's first update, when it asked
    first: bool = False  # the request's first update (echo puts the prompt before it)


class Ticket:
    """A handler's end of one request (one choice of an HTTP request): updates arrive on the
    asyncio queue it may share with the request's other choices, from the loop thread."""

    def __init__(self, request_id: str, arrived: float, index: int = 0, updates: asyncio.Queue | None = None):
        self.id, self.index = request_id, index
        self.arrived = arrived  # perf_counter() when the request reached the server
        self.updates: asyncio.Queue[Update] = asyncio.Queue() if updates is None else updates
        self._event_loop = asyncio.get_running_loop()

    def put(self, update: Update) -> None:
        self._event_loop.call_soon_threadsafe(self.updates.put_nowait, update)


class _Tracked:
    def __init__(self, state: RequestState, ticket: Ticket):
        self.state, self.ticket, self.sent, self.last_at = state, ticket, 0, None
        self.outcome: str | None = None  # why the server cancelled it (a stop string), if it did


class EngineLoop:
    def __init__(self, build: Callable[[], object], metrics, max_queue: int,
                 on_failure: Callable[[str], None] | None = None):
        """build() makes the engine; start() calls it on the loop thread. on_failure(error) is
        called (on the loop thread) once the engine failed and every request got the error."""
        self.engine = None  # build()'s engine, once start() returned
        self._build, self.metrics, self.max_queue, self._on_failure = build, metrics, max_queue, on_failure
        self.admitting = True
        self.failure: str | None = None  # the error that stopped the loop, if one did
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple[Request, Ticket]] = []
        self._cancels: list[tuple[str, str]] = []
        self._tracked: dict[str, _Tracked] = {}
        self._waiting = 0  # requests the engine holds without a slot, as of the last step
        self._free = 0  # free slots, as of the last step
        self._slots = 0  # the engine's slots, once built
        self._stopping = False
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="b12x-engine-loop", daemon=True)

    def start(self) -> None:
        """Start the loop thread and return once it has built the engine; raise what building
        raised (the thread has then ended)."""
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            error, self._build_error = self._build_error, None  # the frames it holds go with it
            raise error

    # -- handler side (event-loop thread) ------------------------------------------------

    def submit(self, requests: list[Request], tickets: list[Ticket]) -> None:
        """Queue the choices of one HTTP request: all of them, or (refused) none."""
        with self._lock:
            if not self.admitting or self.failure is not None:
                raise APIError(503, "the server is shutting down and admits no new requests", "server_error",
                               code="shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
            if len(requests) > self._slots + self.max_queue:  # waiting would not help: never all admitted
                raise APIError(400, f"{len(requests)} choices (prompts times n) cannot be queued at once; this "
                               f"server runs {self._slots} and queues {self.max_queue}", param="n",
                               code="too_many_choices")
            # Requests handed over but not yet taken may still find a free slot: they count as waiting
            # only beyond the slots that were free.
            if max(0, len(self._inbox) + len(requests) - self._free) + self._waiting > self.max_queue:
                raise APIError(503, f"the request queue is full ({self.max_queue} requests wait for a slot); "
                               "retry later", "server_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            self._inbox += zip(requests, tickets)
        self._wake.set()

    def cancel(self, request_id: str, outcome: str = "cancelled") -> None:
        """End a request (its client left, or a stop string ended it); counted under `outcome`."""
        with self._lock:
            self._cancels.append((request_id, outcome))
        self._wake.set()

    def drain(self) -> None:
        with self._lock:
            self.admitting = False

    def running(self) -> int:
        with self._lock:
            return len(self._tracked)

    def stop(self, timeout: float | None = None) -> None:
        """Cancel whatever still runs and end the thread."""
        with self._lock:
            self.admitting, self._stopping = False, True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- loop thread ----------------------------------------------------------------------

    def _run(self) -> None:
        if self._build_engine():
            self._serve()

    def _build_engine(self) -> bool:
        try:
            self.engine = self._build()
            self._free = self._slots = len(self.engine.free)
        except BaseException as exc:  # handed to start(), in the thread that waits for it
            self._build_error = exc
            return False
        finally:
            self._built.set()
        return True

    def _serve(self) -> None:
        while True:
            self._wake.clear()
            with self._lock:
                inbox, cancels, stopping = self._inbox, self._cancels, self._stopping
                self._inbox, self._cancels = [], []
            for request, ticket in inbox:
                self._take(request, ticket)
            if stopping:
                cancels += [(rid, "cancelled") for rid in self._tracked]
            for request_id, outcome in cancels:
                self._cancel(request_id, outcome)
            busy = self.engine.busy
            try:
                if busy:
                    step = self.engine.step()
                else:
                    self.engine.swap_in_compiled()
                between_steps(self.engine.session, idle=not busy)
            except Exception as exc:  # the engine (or a rank) is unusable: every request gets the error
                self._fail(exc)
                return
            if busy:
                self.metrics.record_step(step)
                self._deliver()
            self._publish()
            if stopping and not self.engine.busy:
                return
            if not self.engine.busy:
                self._wake.wait(0.5)

    def _take(self, request: Request, ticket: Ticket) -> None:
        try:
            (state,) = self.engine.submit([request])
        except ValueError as exc:  # protocol.parse checked the limits; this is the engine's last word
            ticket.put(Update([], error=APIError(400, str(exc)), index=ticket.index))
            return
        self._tracked[state.id] = _Tracked(state, ticket)

    def _cancel(self, request_id: str, outcome: str) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return  # already finished
        tracked.outcome = outcome
        self.engine.cancel(request_id)
        self._deliver()

    def _deliver(self) -> None:
        now = time.perf_counter()
        for request_id, tracked in list(self._tracked.items()):
            state = tracked.state
            first, new = tracked.sent == 0, state.tokens[tracked.sent :]
            tracked.sent = len(state.tokens)
            if new:
                self._time_tokens(tracked, len(new), now)
            if not new and not state.done:
                continue
            shown = new
            if state.finish_reason == "stop" and new and new[-1] in state.stop:
                shown = new[:-1]  # as OpenAI does, the stop token itself is not part of the answer
            reason = tracked.outcome or state.finish_reason
            logprobs = state.token_logprobs[len(state.tokens) - len(new) :][: len(shown)] \
                if state.logprobs is not None else None
            prompt_logprobs = state.prompt_token_logprobs if state.prompt_logprobs is not None and first else None
            error = APIError(500, f"the request failed: {state.error}", "server_error", code="request_failed") \
                if state.error is not None else None
            tracked.ticket.put(Update(shown, reason if state.done else None, len(state.prompt), len(state.tokens),
                                      state.cached_tokens, error, tracked.ticket.index, logprobs, prompt_logprobs,
                                      first))
            if state.done:
                del self._tracked[request_id]
                self._count_finished(state, reason)

    def _time_tokens(self, tracked: _Tracked, count: int, now: float) -> None:
        if tracked.last_at is None:
            self.metrics.ttft.observe(now - tracked.ticket.arrived)
            count -= 1
            state = tracked.state
            if state.prefix_tier is not None:
                self.metrics.prefix_hits.labels(state.prefix_tier).inc()
                self.metrics.cached_tokens.inc(state.cached_tokens)
        elif count:
            gap = (now - tracked.last_at) / count
            for _ in range(count):
                self.metrics.itl.observe(gap)
        tracked.last_at = now

    def _count_finished(self, state: RequestState, outcome: str) -> None:
        self.metrics.requests.labels(outcome).inc()
        self.metrics.prompt_tokens.inc(len(state.prompt))
        self.metrics.generated_tokens.inc(len(state.tokens))

    def _publish(self) -> None:
        with self._lock:
            self._waiting, self._free = len(self.engine.waiting), len(self.engine.free)
        self.metrics.queue_depth.set(len(self.engine.waiting))
        self.metrics.running.set(len(self.engine.active))
        self.metrics.record_pages(self.engine.session.pages.pool_stats())
        self.metrics.record_ranks(self.engine.session)
        self.metrics.record_compile(getattr(self.engine.session, "compiler", None))

    def _fail(self, exc: Exception) -> None:
        with self._lock:
            self.failure = f"{type(exc).__name__}: {exc}"
        error = APIError(500, f"the engine failed: {self.failure}", "server_error", code="engine_failure")
        for request_id, tracked in list(self._tracked.items()):
            tracked.ticket.put(Update([], error=error, index=tracked.ticket.index))
            self._count_finished(tracked.state, "error")
        self._tracked.clear()
        if self._on_failure is not None:
            self._on_failure(self.failure)
