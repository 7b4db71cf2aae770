"""JSON read the strict way, for every document a package or a snapshot carries.

`json.loads` keeps the last of two equal keys, so a manifest whose duplicate keeps the
digest's value reads as one document to us and as another to a parser that keeps the
first; it also accepts NaN and Infinity, which are not JSON. Here both are refused,
naming the key or the literal, and so is any value that is not plain JSON data.
"""

from __future__ import annotations

import json

from b12x_toolchain.runtime.errors import PackageError


class StrictJsonError(ValueError):
    """The text is not strict JSON; the message names the key or literal at fault."""


def _object(pairs: list[tuple]) -> dict:
    out = {}
    for key, value in pairs:
        if not isinstance(key, str):  # unreachable from JSON text; kept for hooks that build pairs
            raise StrictJsonError(f"key {key!r} is not a string")
        if key in out:
            raise StrictJsonError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def _constant(literal: str):
    raise StrictJsonError(f"{literal} is not a JSON number")


def loads(data: bytes | str):
    """Parse strict JSON; raises StrictJsonError (a ValueError) for anything else."""
    try:
        return json.loads(data, object_pairs_hook=_object, parse_constant=_constant)
    except StrictJsonError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise StrictJsonError(f"not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None


def load_document(data: bytes | str, what: str, error=PackageError):
    """Parse strict JSON whose failure is `error("{what}: ...")`, naming the document."""
    try:
        return loads(data)
    except StrictJsonError as exc:
        raise error(f"{what}: {exc}") from None


def safetensors_header(data: bytes, what: str, error=PackageError) -> dict:
    """The JSON header of safetensors bytes, read strictly before the format's own parser
    sees it (that parser keeps one of two equal keys, as `json.loads` does)."""
    if len(data) < 8:
        raise error(f"{what}: {len(data)} bytes is shorter than a safetensors header")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise error(f"{what}: header length {size} exceeds the file's {len(data) - 8} bytes after it")
    header = load_document(data[8 : 8 + size], f"{what}: header", error)
    if not isinstance(header, dict):
        raise error(f"{what}: header: expected an object")
    return header
