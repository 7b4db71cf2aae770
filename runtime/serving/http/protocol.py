"""OpenAI request bodies, checked and turned into one engine Request.

Every field is checked before the request reaches the engine, and every refusal names the
field (`param`) and the limit. Fields the server does not implement are refused unless
they hold OpenAI's default value (n=1, logprobs off, ...), so a client never gets a
silently different answer; unknown fields are refused too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from b12x_toolchain.runtime.serving.http.codec import encode_chat
from b12x_toolchain.runtime.serving.http.errors import bad_request, no_tokenizer
from b12x_toolchain.runtime.serving.requests import Request

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP = 16

SAMPLING = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user")
COMPLETION_FIELDS = SAMPLING + ("prompt",)
CHAT_FIELDS = SAMPLING + ("messages", "max_completion_tokens")

# Accepted only at the value that means "off": anything else would change the answer's meaning.
DEFAULT_ONLY = {"n": (1,), "best_of": (1,), "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (False,),
                "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": (None, {}),
                "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
                "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,),
                "service_tier": (None, "auto", "default")}
COMPLETION_DEFAULT_ONLY = ("n", "best_of", "logprobs", "echo", "presence_penalty", "frequency_penalty", "logit_bias",
                           "suffix")
CHAT_DEFAULT_ONLY = ("n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "tools",
                     "tool_choice", "response_format", "parallel_tool_calls", "service_tier")


@dataclass
class Generation:
    """One checked request: what the engine runs and how the answer is shaped."""

    chat: bool
    request: Request
    text: bool  # the prompt came as text (or messages), so the answer is text
    stream: bool = False
    include_usage: bool = False
    stop_strings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_seq_len: int


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_fields(body: dict, fields: tuple, default_only: tuple) -> None:
    for name, value in body.items():
        if name in fields:
            continue
        if name in default_only:
            if value not in DEFAULT_ONLY[name] or isinstance(value, bool) != isinstance(DEFAULT_ONLY[name][0], bool):
                raise bad_request(f"{name}={value!r} is not supported by this server; "
                                  f"leave it out or send {DEFAULT_ONLY[name][0]!r}", name, "unsupported_parameter")
            continue
        raise bad_request(f"unknown parameter {name!r}", name, "unknown_parameter")


def _prompt_ids(prompt, codec, limits: Limits) -> tuple[list[int], bool]:
    """The prompt's token ids and whether it came as text."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        if codec is None:
            raise no_tokenizer("prompt")
        return codec.encode(prompt), True
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        for i, token in enumerate(prompt):
            if not 0 <= token < limits.vocab_size:
                raise bad_request(f"prompt token {token} (index {i}) is out of range; expected a token id in "
                                  f"[0, {limits.vocab_size})", "prompt", "invalid_token_id")
        return list(prompt), False
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("one prompt per request: send a string or a list of token ids", "prompt")
    raise bad_request("prompt must be a non-empty string or a non-empty list of integer token ids", "prompt")


def _chat_ids(messages, codec) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise bad_request("each message needs a string role and a string content", "messages")
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
    if all(_is_int(v) for v in values):
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
    param = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    value = body.get(param)
    room = limits.max_seq_len - prompt_len
    if room < 1:
        raise bad_request(f"the prompt has {prompt_len} tokens; this model's max_seq_len {limits.max_seq_len} "
                          f"leaves room for at most {limits.max_seq_len - 1} prompt tokens",
                          "messages" if chat else "prompt", "context_length_exceeded")
    if value is None:
        return room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
    if not _is_int(value) or value < 1:
        raise bad_request(f"{param} must be an integer of at least 1, got {value!r}", param)
    if value > room:
        raise bad_request(f"{param} {value} plus the prompt's {prompt_len} tokens exceeds this model's max_seq_len "
                          f"{limits.max_seq_len}; at most {room} new tokens fit", param, "context_length_exceeded")
    return value


def parse(body, chat: bool, codec, limits: Limits, request_id: str) -> Generation:
    """Check an OpenAI completions (or chat completions) body; raises APIError naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, CHAT_DEFAULT_ONLY if chat else COMPLETION_DEFAULT_ONLY)
    if chat:
        ids, text = _chat_ids(body.get("messages"), codec), True
    else:
        if "prompt" not in body:
            raise bad_request("prompt is required", "prompt")
        ids, text = _prompt_ids(body["prompt"], codec, limits)
    max_tokens = _max_tokens(body, chat, len(ids), limits)
    temperature, top_p, seed = body.get("temperature"), body.get("top_p"), body.get("seed")
    if temperature is not None and not (_is_number(temperature) and 0 <= temperature <= 2):
        raise bad_request(f"temperature must be a number in [0, 2], got {temperature!r}", "temperature")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise bad_request(f"top_p must be a number in (0, 1], got {top_p!r}", "top_p")
    if seed is not None and not _is_int(seed):
        raise bad_request(f"seed must be an integer, got {seed!r}", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad_request("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}):
        raise bad_request("stream_options may only hold include_usage", "stream_options")
    stop_ids, stop_strings = _stop(body.get("stop"), codec, limits)
    if codec is not None and codec.eos_id is not None:
        stop_ids.append(codec.eos_id)
    request = Request(ids, max_tokens, tuple(stop_ids), request_id, seed,
                      None if temperature is None else float(temperature), None if top_p is None else float(top_p))
    return Generation(chat, request, text, bool(stream), bool((options or {}).get("include_usage")), stop_strings)
