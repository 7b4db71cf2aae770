"""The engine's executor: runs what the scheduler planned, through the session's passes.

Prefill (after hydrating each row from its longest stored prefix), then per group draft ->
verify -> accept -> commit, or one token through the decode pass; the host chooses tokens
from one transfer per replay. Each request's counters and tokens are updated here; which
request runs, and when, is the scheduler's (scheduler.py).

A slot changes hands by resetting its committed length. Row ids and positions are graph
inputs and every cache read is masked by position, so the previous request's rows are
invisible to the next one and no graph is captured again.
"""

from __future__ import annotations

import time

import torch

from b12x_toolchain.runtime.serving.drafts import Drafts, device_drafts
from b12x_toolchain.runtime.serving.logprobs import token_logprobs
from b12x_toolchain.runtime.serving.requests import RequestState
from b12x_toolchain.runtime.serving.sampling import accept_greedy, accept_sampled, draw, probabilities, top_two_gap
from b12x_toolchain.runtime.serving.scheduler import check_slot_ids, restores
from b12x_toolchain.runtime.serving.stats import StepStats
from b12x_toolchain.runtime.session.transfers import download, to_device


class Executor:
    def __init__(self, session, slots: list[int], span, *, speculative: bool, drafter, prefix_cache,
                 decode_pass: str | None, policy=None):
        """span(request): the most tokens a request's slot may hold (the scheduler's).
        policy: a DraftPolicy (draft_policy.py) that lets rows of a drafting engine decode
        through the decode pass while drafting does not pay; None: every row drafts."""
        self.session, self.slots, self.span = session, slots, span
        self.speculative, self.drafter, self.prefix_cache = speculative, drafter, prefix_cache
        self.decode_pass, self.policy = decode_pass, policy
        package = session.package
        self.vocab_size = package.vocab_size
        self.noise = package.manifest.model.noise_token_id
        self.draft_width = package.passes["draft"].width
        self.chunk = package.passes["prefill"].width

    def decode(self, plan, stats: StepStats) -> None:
        """One step's DecodePlan: every group decodes once, the tail one token at a time."""
        for group in plan.groups:
            if self.policy is None:
                self.decode_group(group, stats)
            else:
                self._decode_as_it_pays(group, stats)
        for group in plan.tail:
            self.decode_one(group, stats)

    def _decode_as_it_pays(self, group: list[RequestState], stats: StepStats) -> None:
        """Draft, verify and commit the group while that pays (draft_policy.py); else decode it."""
        start = time.perf_counter()
        if self.policy.drafts(group):
            before = [r.accepted for r in group]
            self.decode_group(group, stats)
            self.policy.drafted(group, [r.accepted - b + 1 for r, b in zip(group, before)],
                                time.perf_counter() - start)
        else:
            self.decode_one(group, stats, "decode")
            self.policy.decoded(group, time.perf_counter() - start)
            stats.aside_rows += len(group)

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
            if not self._hydrate(request, reserve, last):
                deferred.append(request)
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

    def _hydrate(self, request: RequestState, reserve: bool, last: dict) -> bool:
        """Start a row from an empty slot or its longest stored prefix; False when the pages it
        then still needs cannot be had. An exact hit's stored logits give its first token (`last`)."""
        cache = self.prefix_cache
        self.session.reset_slot(request.slot)
        request.length = 0
        hit = cache.restore(self.session, request.slot, request.prompt) if restores(cache, request) else None
        # What the slot still needs now that its shared pages are known. Admission reserved for
        # the hit it expected; a different one (from L2, copied) may need more than can be had.
        committed, span = hit.length if hit else 0, self.span(request)
        if reserve and not self.session.pages.can_reserve(request.slot, committed, span):
            return False
        if reserve:
            self.session.pages.reserve(request.slot, committed, span)
        request.cached_tokens, request.prefix_tier = (hit.length, hit.tier) if hit else (0, None)
        if hit is not None:
            request.length = hit.length
            if hit.length == len(request.prompt):
                last[request.slot] = hit.snapshot.logits
        return True

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
            return self.decode_one(rows, stats)
        slots, positions = [r.slot for r in rows], [r.length for r in rows]
        check_slot_ids(slots, self.slots)
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

    def decode_one(self, rows: list[RequestState], stats: StepStats, name: str | None = None) -> None:
        """One token per row through decode (or prefill), which writes the pending token's rows directly."""
        slots = [r.slot for r in rows]
        check_slot_ids(slots, self.slots)
        name = name or self.decode_pass or "prefill"
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

