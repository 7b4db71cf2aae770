"""The manifest's own digest: what `manifest_sha256` must be, in a module that needs no torch
(the command that launches ranks checks it before it hands over)."""

from __future__ import annotations

import hashlib
import json


def digest(data: dict) -> str:
    """sha256 of a manifest's JSON without its own digest: catches a flipped byte in it."""
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def digest_holds(data: dict) -> bool:
    """Whether the manifest's `manifest_sha256` is the digest of the rest of it."""
    return data.get("manifest_sha256") == digest(data)
