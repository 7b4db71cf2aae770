"""What a prefix snapshot is keyed by: the package's identity and the exact token ids.

The identity names everything that decides the bytes of a slot's caches: the recipe (its
sha256 covers shapes, ratios, window, prefill chunk and cache formats), the weights, the
op set, the package format and the cache buffers themselves. It is a JSON object with
named fields, hashed canonically, so two different settings can never run together into
the same key (no concatenated strings to confuse, no salt that can be left out).

Token ids are hashed as int32 little-endian bytes behind the identity key, so equal
prompts in two models hash differently. A hash only filters candidates: every tier
compares the token bytes exactly before it returns a snapshot, so a collision costs a
comparison, never a wrong prefix.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from dataclasses import dataclass, field

from b12x_toolchain.runtime import strict_json
from b12x_toolchain.runtime.errors import SnapshotError
from b12x_toolchain.runtime.package.kinds import TOKEN_BYTES

SNAPSHOT_SCHEMA = 2  # 2: paged caches as whole pages. Bump when what a snapshot holds or how it is laid out changes
KEY_PREFIX = 16  # hex digits of the identity key that L2 file names carry


@dataclass(frozen=True)
class Identity:
    fields: dict = field(compare=False)
    key: str  # sha256 of the canonical JSON of `fields`

    @classmethod
    def of(cls, fields: dict) -> "Identity":
        """The identity of `fields`, which must be plain JSON data: the key hashes their canonical
        text, and reading that text back strictly is what the fields become (what a snapshot
        file records). Keys 1 and "1" would write one key twice, and NaN is not JSON: both refused."""
        try:
            text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
            canonical = strict_json.loads(text)
        except (TypeError, ValueError) as exc:  # StrictJsonError is a ValueError
            raise SnapshotError(f"identity fields {str(fields)[:200]}: expected plain JSON data ({exc})") from None
        return cls(canonical, hashlib.sha256(text.encode()).hexdigest())

    def to_json(self) -> dict:
        return {"key": self.key, "fields": self.fields}


def package_identity(package) -> Identity:
    """The identity of a loaded package (the weights' hash is None when they are external or
    per rank)."""
    m = package.manifest
    cache = m.recipe.get("cache") or {}
    # Per slot (without "slots"), and what the rows are: kind, format, dims, ratio.
    caches = {spec.name: [spec.dtype, list(spec.shape[1:]), spec.info.to_json() if spec.info else None]
              for spec in package.caches}
    return Identity.of({
        "schema": SNAPSHOT_SCHEMA,
        "format_version": m.format_version,
        "opset_version": m.opset_version,
        "recipe_sha256": m.recipe_sha256,
        "weights_sha256": m.files.get(m.weights.file),
        "cache_formats": {k: cache.get(f"{k}_format") for k in ("window", "compressed", "state")},
        "caches": caches,
    })


def token_bytes(tokens) -> bytes:
    """Token ids as int32 little-endian bytes: the form every tier stores and compares."""
    if isinstance(tokens, (bytes, bytearray)):
        return bytes(tokens)
    try:
        arr = array("i", tokens)
    except OverflowError:
        raise ValueError("token ids must fit in int32") from None
    if arr.itemsize != TOKEN_BYTES:
        raise RuntimeError("this platform's C int is not 32 bits")
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def token_ids(data: bytes) -> list[int]:
    arr = array("i")
    arr.frombytes(data)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


def _hasher(key: str):
    # One place builds every token hash, so a test can force collisions here.
    return hashlib.sha256(b"b12x.tokens\0" + key.encode() + b"\0")


def prefix_hashes(key: str, tokens: bytes, lengths) -> dict[int, str]:
    """Hashes of the first L tokens for every L in `lengths`, in one pass over the bytes."""
    h, done, out = _hasher(key), 0, {}
    view = memoryview(tokens)
    for length in sorted(set(lengths)):
        if not 0 <= length * TOKEN_BYTES <= len(tokens):
            raise ValueError(f"prefix length {length} is outside the {len(tokens) // TOKEN_BYTES} tokens given")
        h.update(view[done * TOKEN_BYTES : length * TOKEN_BYTES])
        done = length
        out[length] = h.copy().hexdigest()
    return out


def token_hash(key: str, tokens: bytes) -> str:
    count = len(tokens) // TOKEN_BYTES
    return prefix_hashes(key, tokens, [count])[count]
