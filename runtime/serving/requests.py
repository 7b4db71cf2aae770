"""What a caller asks the engine for, and what the engine tracks and hands back per request.

Every request is checked against the model when it is submitted, before any replay, so
a bad request in a batch stops the batch with an error naming the request instead of
failing mid-run with other requests half decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only named in annotations: the CLI parses requests without loading torch
    import torch


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...] | list[int]
    max_new_tokens: int = 32
    stop: tuple[int, ...] | list[int] = ()  # generation ends after emitting one of these (it is kept)
    id: object = None  # any hashable label; the engine numbers requests that bring none
    seed: int | None = None  # sampling seed of this request; default: derived from the engine's seed
    temperature: float | None = None  # this request's sampling temperature; default: the engine's
    top_p: float | None = None  # nucleus sampling mass in (0, 1]; default: the engine's
    min_tokens: int = 0  # a stop token ends the request only once this many tokens were generated
    logprobs: int | None = None  # each generated token's log-probability and this many top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (prefills it all)


# Temperatures below this decode greedily: 1/T would scale logits past what float64 softmax
# keeps apart, and a denormal T overflows it to inf (vLLM's sampler draws the same line).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target's raw logits (before temperature and top-p),
    and the `top` most likely tokens as (token id, log-probability), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestState:
    """A request's state, the one record of it the engine and the `Decoder` keep; `generate`
    returns these, finished, in submission order.

    `length` tokens are committed to the slot's caches and `pending` is the next token,
    already emitted but not yet in the caches. Drafters see these rows.
    """

    id: object
    prompt: list[int]
    max_new_tokens: int
    stop: frozenset[int]
    generator: torch.Generator
    slot: int = -1
    length: int = 0
    pending: int = -1
    tokens: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # top-2 logit gap behind each emitted token
    finish_reason: str | None = None  # "length", "stop", "cancelled" (Engine.cancel) or "error"
    steps: int = 0  # decoding steps this request took part in
    accepted: int = 0  # drafts of this request the target accepted
    submitted_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    temperature: float = 0.0
    top_p: float = 1.0
    cached_tokens: int = 0  # prompt tokens a prefix snapshot restored instead of prefill
    prefix_tier: str | None = None  # where that snapshot came from: "l1" or "l2"
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    token_logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when logprobs is set
    prompt_token_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt[1:], when asked
    error: str | None = None  # why the request failed (finish_reason "error"); other requests go on
    speculation: float | None = None  # a greedy request's tokens per verify step, averaged (draft_policy.py)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def latency_s(self) -> float:
        """Submission to last token, queueing included."""
        return self.finished_at - self.submitted_at

    @property
    def first_token_s(self) -> float:
        return self.first_token_at - self.submitted_at

    def emit(self, tokens: list[int], margins: list[float], logprobs: list[TokenLogprob] | None = None) -> None:
        """Hand tokens to the request, stopping at a stop token (once min_tokens are out) or at
        max_new_tokens; `logprobs`, when the request asked for them, go with their tokens."""
        for i, (token, gap) in enumerate(zip(tokens, margins)):
            self.tokens.append(token)
            self.margins.append(gap)
            if logprobs is not None:
                self.token_logprobs.append(logprobs[i])
            if token in self.stop and len(self.tokens) >= self.min_tokens:
                self.finish_reason = "stop"
            elif len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = "length"
            if self.done:
                return


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_request(request: Request, label: str, vocab_size: int, max_seq_len: int) -> None:
    """Raise ValueError naming the request and the problem; the request is otherwise servable."""
    prompt, max_new = request.prompt, request.max_new_tokens
    if not isinstance(prompt, (list, tuple)) or not all(is_int(t) for t in prompt):
        raise ValueError(f"request {label}: prompt must be a list of integer token ids")
    if not prompt:
        raise ValueError(f"request {label}: prompt is empty; at least one token is needed")
    for i, token in enumerate(prompt):
        if not 0 <= token < vocab_size:
            # Worded like the session's own input check, which this one runs ahead of.
            raise ValueError(f"request {label}: prompt tokens: value {token} is out of range (index {i}); "
                             f"expected a token id in [0, {vocab_size})")
    if not is_int(max_new) or max_new < 1:
        raise ValueError(f"request {label}: max_new_tokens must be an integer of at least 1, got {max_new!r}")
    if len(prompt) >= max_seq_len:
        raise ValueError(f"request {label}: prompt of {len(prompt)} tokens is longer than the model's limit of "
                         f"{max_seq_len - 1} prompt tokens (max_seq_len {max_seq_len}, one new token at least)")
    if len(prompt) + max_new > max_seq_len:
        raise ValueError(f"request {label}: prompt of {len(prompt)} tokens plus max_new_tokens {max_new} exceeds "
                         f"the model's max_seq_len {max_seq_len}; at most {max_seq_len - len(prompt)} new tokens fit")
    if not isinstance(request.stop, (list, tuple, set, frozenset)) or not all(is_int(t) for t in request.stop):
        raise ValueError(f"request {label}: stop must be a list of integer token ids")
    for token in request.stop:
        if not 0 <= token < vocab_size:
            raise ValueError(f"request {label}: stop token {token} is out of range; "
                             f"expected a token id in [0, {vocab_size})")
    if request.seed is not None and not is_int(request.seed):
        raise ValueError(f"request {label}: seed must be an integer, got {request.seed!r}")
    temperature, top_p = request.temperature, request.top_p
    if temperature is not None and not (is_number(temperature) and temperature >= 0):
        raise ValueError(f"request {label}: temperature must be a finite number >= 0, got {temperature!r}")
    if top_p is not None and not (is_number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"request {label}: top_p must be a number in (0, 1], got {top_p!r}")
    if not is_int(request.min_tokens) or not 0 <= request.min_tokens <= max_new:
        raise ValueError(f"request {label}: min_tokens must be an integer in [0, max_new_tokens {max_new}], "
                         f"got {request.min_tokens!r}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(request, name)
        if value is not None and not (is_int(value) and 0 <= value <= vocab_size):
            raise ValueError(f"request {label}: {name} must be an integer in [0, {vocab_size}], got {value!r}")


def is_number(value) -> bool:
    """A finite int or float (bool is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
