"""Prompts for `b12x run`: texts, token-id strings and prompt files, as runtime Requests.

A prompt file holds one prompt per line, either as token ids (comma or space
separated) or as JSON: a list of ids, or an object with `prompt` (a list of ids, or a
text) and optionally `max_new_tokens`, `stop`, `id` and `seed`. Blank lines and lines
starting with `#` are skipped. Each request remembers where it came from (`file:line`),
so an error about it points at the line to fix.

A text prompt stays text until the package is loaded: `encode_texts` encodes it with the
package's tokenizer, whose end-of-text token becomes the stop of every request that sets
no stop of its own.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from b12x_toolchain.exporter.errors import PromptError  # noqa: F401  (re-exported)
from b12x_toolchain.runtime.serving.requests import Request

JSON_KEYS = ("prompt", "max_new_tokens", "stop", "id", "seed")


@dataclass(frozen=True)
class Defaults:
    max_new_tokens: int
    stop: tuple[int, ...]


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise PromptError(f"{text!r} is not a list of integer token ids") from None


def from_ids(text: str, origin: str, defaults: Defaults) -> tuple[Request, str]:
    return Request(parse_ids(text), defaults.max_new_tokens, defaults.stop), origin


def from_text(text: str, origin: str, defaults: Defaults) -> tuple[Request, str]:
    return Request(text, defaults.max_new_tokens, defaults.stop), origin


def encode_texts(items: list[tuple[Request, str]], codec, package: str) -> list[tuple[Request, str]]:
    """`items` with every text prompt encoded by `codec` (the package's TextCodec, or None when
    it has no tokenizer), and the codec's eos as the stop of requests that set none."""
    texts = [origin for request, origin in items if isinstance(request.prompt, str)]
    if texts and codec is None:
        raise PromptError(f"{package}: the package has no tokenizer, so {texts[0]} cannot be a text prompt; give "
                          "token ids (--prompt-ids), or export it from a checkpoint that has a tokenizer.json")
    out = []
    for request, origin in items:
        changes = {}
        if isinstance(request.prompt, str):
            changes["prompt"] = codec.encode(request.prompt)
        if codec is not None and codec.eos_id is not None and not request.stop:
            changes["stop"] = (codec.eos_id,)
        out.append((dataclasses.replace(request, **changes), origin))
    return out


def _from_json(value, origin: str, defaults: Defaults) -> Request:
    if isinstance(value, list):
        value = {"prompt": value}
    if not isinstance(value, dict):
        raise PromptError(f"{origin}: expected a JSON object or a list of token ids, got {type(value).__name__}")
    unknown = sorted(set(value) - set(JSON_KEYS))
    if unknown:
        raise PromptError(f"{origin}: unknown key {unknown[0]!r}; expected {', '.join(JSON_KEYS)}")
    if "prompt" not in value:
        raise PromptError(f"{origin}: no 'prompt' key")
    # Types are checked with the request itself (check_request), against the model's limits.
    return Request(value["prompt"], value.get("max_new_tokens", defaults.max_new_tokens),
                   value.get("stop", defaults.stop), value.get("id"), value.get("seed"))


def read_prompt_file(path: Path, defaults: Defaults) -> list[tuple[Request, str]]:
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text, origin = line.strip(), f"{path.name}:{number}"
        if not text or text.startswith("#"):
            continue
        if text[0] in "[{":
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise PromptError(f"{origin}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            out.append((_from_json(value, origin, defaults), origin))
        else:
            try:
                out.append(from_ids(text, origin, defaults))
            except PromptError as exc:
                raise PromptError(f"{origin}: {exc}") from None
    if not out:
        raise PromptError(f"{path.name}: no prompts in this file")
    return out
