"""A request body, read within the server's limits and checked before any route reads it.

Limits: `max_body_bytes`, a deadline for the whole body (a client trickling it is answered
408 and holds no slot: nothing reaches the engine before the body is complete), JSON
nesting of at most MAX_DEPTH, numbers that are finite (no NaN/Infinity constants, no
literal so large it reads as infinity), and strings (keys too) that are Unicode text: a
lone UTF-16 surrogate, which JSON's \\u escapes can spell, is refused with the field's path.
"""

from __future__ import annotations

import asyncio
import json
import math

from b12x_toolchain.runtime.serving.http.errors import APIError, bad_request

MAX_DEPTH = 32


async def read_json(request, limit: int, timeout_s: float):
    """The parsed body, or an APIError (400, 408 or 413) saying what is wrong with it."""
    too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large

    async def receive() -> bytes:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        return bytes(body)

    try:
        raw = await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout") \
            from None
    return parse_json(raw)


def _constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes):
    try:
        value = json.loads(raw, parse_constant=_constant)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    check_value(value)
    return value


def check_value(value) -> None:
    """Depth, finite numbers and well-formed strings, walked without recursion."""
    stack = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_DEPTH} levels", path.lstrip(".") or None,
                              "invalid_json")
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, float) and not math.isfinite(item):
            raise bad_request(f"{path.lstrip('.') or 'the body'}: {item} is not a finite number",
                              path.lstrip(".") or None, "invalid_number")
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, path + ".<key>")
                stack.append((child, f"{path}.{key}", depth + 1))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        name = path.lstrip(".") or None
        raise bad_request(f"{name or 'the body'}: {text[exc.start]!r} at index {exc.start} is a lone UTF-16 "
                          "surrogate, not a character; send valid Unicode", name, "invalid_unicode") from None
