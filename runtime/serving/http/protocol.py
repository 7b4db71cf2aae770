"""OpenAI request bodies, checked and turned into the engine Requests of their choices.

Every field is checked before the request reaches the engine, and every refusal names the
field (`param`) and the limit. Fields the server does not implement are refused unless
they hold their documented default (best_of=1, presence_penalty=0, repetition_penalty=1,
...), so a client never gets a silently different answer; unknown fields are refused too.

A completions `prompt` may be one prompt or a batch (a list of strings, or of token-id
lists); each prompt gets `n` choices, indexed prompt by prompt (vLLM's order). Sample j
of a request with a seed draws with seed + j, so each choice equals a one-choice request
with that seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from b12x_toolchain.runtime.serving.http.codec import encode_chat
from b12x_toolchain.runtime.serving.http.errors import bad_request, no_tokenizer
from b12x_toolchain.runtime.serving.requests import Request, is_int, is_number

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP = 16
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs; vLLM's default for both APIs
MAX_CHOICES = 128  # prompts times n in one request

SAMPLING = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user", "n",
            "ignore_eos", "min_tokens")
COMPLETION_FIELDS = SAMPLING + ("prompt", "echo", "logprobs")
CHAT_FIELDS = SAMPLING + ("messages", "max_completion_tokens", "logprobs", "top_logprobs")

# Accepted only at the value that means "off": anything else would change the answer's meaning.
DEFAULT_ONLY = {"best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
                "repetition_penalty": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""),
                "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
                "parallel_tool_calls": (None,), "service_tier": (None, "auto", "default"), "top_k": (None, -1, 0),
                "min_p": (None, 0), "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
                "spaces_between_special_tokens": (None, True), "echo": (None, False)}
COMPLETION_DEFAULT_ONLY = ("best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                           "suffix", "top_k", "min_p", "include_stop_str_in_output", "skip_special_tokens",
                           "spaces_between_special_tokens")
CHAT_DEFAULT_ONLY = COMPLETION_DEFAULT_ONLY[:-2] + ("tools", "tool_choice", "response_format", "parallel_tool_calls",
                                                    "service_tier", "echo", "skip_special_tokens",
                                                    "spaces_between_special_tokens")


@dataclass
class Generation:
    """One checked request: the engine requests of its choices and how the answer is shaped."""

    chat: bool
    requests: list[Request]  # one per choice, in choice order
    prompts: list[list[int]]  # each prompt's ids; choice i answers prompts[i // n]
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # every streamed chunk carries the usage so far
    stop_strings: list[str] = field(default_factory=list)
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token (chat: top_logprobs), None: no logprobs


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_seq_len: int


def _is_default(value, defaults: tuple) -> bool:
    # bool is an int in Python: False must not pass for 0, nor True for 1.
    return any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults)


def check_fields(body: dict, fields: tuple, default_only: tuple) -> None:
    for name, value in body.items():
        if name in fields:
            continue
        if name in default_only:
            if not _is_default(value, DEFAULT_ONLY[name]):
                shown = [d for d in DEFAULT_ONLY[name] if d is not None][:1] or [None]
                raise bad_request(f"{name}={value!r} is not supported by this server; "
                                  f"leave it out or send {shown[0]!r}", name, "unsupported_parameter")
            continue
        raise bad_request(f"unknown parameter {name!r}", name, "unknown_parameter")


def _token_ids(prompt: list, limits: Limits) -> list[int]:
    for i, token in enumerate(prompt):
        if not 0 <= token < limits.vocab_size:
            raise bad_request(f"prompt token {token} (index {i}) is out of range; expected a token id in "
                              f"[0, {limits.vocab_size})", "prompt", "invalid_token_id")
    return list(prompt)


def _prompts(prompt, codec, limits: Limits) -> list[list[int]]:
    """The ids of each prompt: one string or token-id list, or a non-empty list of either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)):
        prompt = [prompt]
    if not (isinstance(prompt, list) and prompt):
        raise bad_request("prompt must be a non-empty string, a non-empty list of integer token ids, or a "
                          "non-empty list of either", "prompt")
    ids = []
    for one in prompt:
        if isinstance(one, str) and one:
            if codec is None:
                raise no_tokenizer("prompt")
            ids.append(codec.encode(one))
            if not ids[-1]:
                raise bad_request("a prompt encodes to no tokens", "prompt")
        elif isinstance(one, list) and one and all(is_int(t) for t in one):
            ids.append(_token_ids(one, limits))
        else:
            raise bad_request("each prompt of a batch must be a non-empty string or a non-empty list of integer "
                              "token ids", "prompt")
    return ids


def _content(content) -> str:
    """A message's text: a string, or a list of text parts (joined by newlines, as vLLM joins
    them for a template that takes a string)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        for part in content:
            if not (isinstance(part, dict) and isinstance(part.get("type"), str)):
                raise bad_request("each content part must be an object with a type", "messages")
            if part["type"] != "text" or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                raise bad_request(f"content part type {part['type']!r:.40} is not supported; this model takes "
                                  "text parts {type: text, text: string}", "messages", "unsupported_content")
        return "\n".join(part["text"] for part in content)
    raise bad_request("a message's content must be a string or a non-empty list of text parts", "messages")


def chat_ids(messages, codec) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message):
            raise bad_request("each message needs a string role and a content", "messages")
    messages = [{"role": m["role"], "content": _content(m["content"])} for m in messages]
    if codec is None:
        raise no_tokenizer("messages")
    try:
        return encode_chat(codec, messages)
    except ValueError as exc:  # no chat template, or the template refused the conversation
        raise bad_request(str(exc), "messages", "chat_template") from None


def _stop(value, codec, limits: Limits) -> tuple[list[int], list[str]]:
    """Stop token ids and stop strings: a string, a list of strings, or a list of token ids."""
    if value is None:
        return [], []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or len(values) > MAX_STOP:
        raise bad_request(f"stop must be a string, or a list of at most {MAX_STOP} strings or token ids", "stop")
    if all(is_int(v) for v in values):
        for token in values:
            if not 0 <= token < limits.vocab_size:
                raise bad_request(f"stop token {token} is out of range; expected a token id in [0, "
                                  f"{limits.vocab_size})", "stop", "invalid_token_id")
        return list(values), []
    if all(isinstance(v, str) and v for v in values):
        if codec is None:
            raise no_tokenizer("stop")
        return [], list(values)
    raise bad_request("stop must be a string, or a list of non-empty strings or of integer token ids", "stop")


def _max_tokens(body: dict, chat: bool, prompt_len: int, limits: Limits) -> int:
    param = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(param)
    room = limits.max_seq_len - prompt_len
    if room < 1:
        raise bad_request(f"the prompt has {prompt_len} tokens; this model's max_seq_len {limits.max_seq_len} "
                          f"leaves room for at most {limits.max_seq_len - 1} prompt tokens",
                          "messages" if chat else "prompt", "context_length_exceeded")
    if value is None:
        return room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
    if not is_int(value) or value < 1:
        raise bad_request(f"{param} must be an integer of at least 1, got {value!r}", param)
    if value > room:
        raise bad_request(f"{param} {value} plus the prompt's {prompt_len} tokens exceeds this model's max_seq_len "
                          f"{limits.max_seq_len}; at most {room} new tokens fit", param, "context_length_exceeded")
    return value


def _optional(body: dict, name: str, valid, expected: str):
    value = body.get(name)
    if value is not None and not valid(value):
        raise bad_request(f"{name} must be {expected}, got {value!r}", name)
    return value


def _logprobs(body: dict, chat: bool) -> int | None:
    """Top alternatives per token, or None: completions send logprobs=N (false/null: off), chat
    sends logprobs=true with top_logprobs=N."""
    in_range = lambda v: is_int(v) and 0 <= v <= MAX_LOGPROBS  # noqa: E731
    if not chat:
        value = body.get("logprobs")
        if value is None or value is False:
            return None
        return _optional(body, "logprobs", in_range, f"an integer in [0, {MAX_LOGPROBS}]")
    wanted = _optional(body, "logprobs", lambda v: isinstance(v, bool), "true or false")
    top = _optional(body, "top_logprobs", in_range, f"an integer in [0, {MAX_LOGPROBS}]")
    if top and not wanted:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def _stream_options(body: dict, stream: bool) -> dict:
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if options is None:
        return {}
    for name, value in options.items():
        if name not in ("include_usage", "continuous_usage_stats"):
            raise bad_request(f"stream_options may hold include_usage and continuous_usage_stats, not {name!r}",
                              "stream_options")
        if not isinstance(value, bool) and value is not None:
            raise bad_request(f"stream_options.{name} must be true or false, got {value!r}", "stream_options")
    return options


def parse(body, chat: bool, codec, limits: Limits, request_id: str) -> Generation:
    """Check an OpenAI completions (or chat completions) body; raises APIError naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, CHAT_DEFAULT_ONLY if chat else COMPLETION_DEFAULT_ONLY)
    _optional(body, "model", lambda v: isinstance(v, str), "a string")
    _optional(body, "user", lambda v: isinstance(v, str), "a string")
    if chat:
        prompts = [chat_ids(body.get("messages"), codec)]
    else:
        if body.get("prompt") is None:
            raise bad_request("prompt is required", "prompt")
        prompts = _prompts(body["prompt"], codec, limits)
    max_tokens = _max_tokens(body, chat, max(len(p) for p in prompts), limits)
    temperature = _optional(body, "temperature", lambda v: is_number(v) and 0 <= v <= 2, "a number in [0, 2]")
    top_p = _optional(body, "top_p", lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]")
    seed = _optional(body, "seed", is_int, "an integer")
    n = _optional(body, "n", lambda v: is_int(v) and v >= 1, "an integer of at least 1") or 1
    if n * len(prompts) > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts times n={n} is {n * len(prompts)} choices; this server answers "
                          f"at most {MAX_CHOICES} in one request", "n")
    min_tokens = _optional(body, "min_tokens", lambda v: is_int(v) and 0 <= v <= max_tokens,
                           f"an integer in [0, max_tokens {max_tokens}]") or 0
    ignore_eos = _optional(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false")
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "true or false") or False
    options = _stream_options(body, stream)
    echo = False if chat else bool(_optional(body, "echo", lambda v: isinstance(v, bool), "true or false"))
    logprobs = _logprobs(body, chat)
    stop_ids, stop_strings = _stop(body.get("stop"), codec, limits)
    if codec is not None and codec.eos_id is not None and not ignore_eos:
        stop_ids.append(codec.eos_id)
    requests = [Request(ids, max_tokens, tuple(stop_ids), f"{request_id}-{i * n + j}",
                        None if seed is None else seed + j, None if temperature is None else float(temperature),
                        None if top_p is None else float(top_p), min_tokens, logprobs,
                        logprobs if echo else None)
                for i, ids in enumerate(prompts) for j in range(n)]
    return Generation(chat, requests, prompts, n, stream, bool(options.get("include_usage")),
                      bool(options.get("continuous_usage_stats")), stop_strings, echo, logprobs)
