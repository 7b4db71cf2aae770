"""Synthetic snapshots whose bytes follow from their tokens, so any reader can check them.

The tier tests (L1, L2, processes) need many snapshots of chosen sizes, not a model:
`make_snapshot` derives every byte from the token ids, and `is_intact` recomputes them,
so a snapshot that comes back from a tier under any interleaving can be proven whole.
"""

from __future__ import annotations

import hashlib

import torch

from b12x_toolchain.runtime.package.kinds import TOKEN_BYTES
from b12x_toolchain.runtime.prefix.keys import SNAPSHOT_SCHEMA, Identity, token_bytes, token_hash
from b12x_toolchain.runtime.prefix.snapshot import Snapshot

RING = "cache.layer0.window"
APPEND = "cache.layer1.compressed"


def fake_identity(tag: str = "a") -> Identity:
    return Identity.of({"schema": SNAPSHOT_SCHEMA, "test": tag})


def make_snapshot(identity: Identity, tokens, row_bytes: int = 64, capacity: int = 8, logits: bool = True) -> Snapshot:
    data = token_bytes(tokens)
    length = len(data) // TOKEN_BYTES
    gen = torch.Generator().manual_seed(int(hashlib.sha256(identity.key.encode() + data).hexdigest()[:12], 16))
    ring_rows, append_rows = min(length, capacity), length // 2
    caches = {
        RING: torch.randint(0, 256, (ring_rows, row_bytes), dtype=torch.uint8, generator=gen),
        APPEND: torch.randint(0, 256, (append_rows, row_bytes), dtype=torch.uint8, generator=gen),
    }
    meta = {
        RING: {"kind": "ring", "row_bytes": row_bytes, "rows": ring_rows, "offset": length, "capacity": capacity,
               "ring_index": length % capacity},
        APPEND: {"kind": "append", "row_bytes": row_bytes, "rows": append_rows, "offset": length, "ratio": 2},
    }
    out = torch.randn(16, generator=gen) if logits else None
    return Snapshot(identity, length, data, token_hash(identity.key, data), caches, meta, out)


def is_intact(snap: Snapshot, row_bytes: int = 64, capacity: int = 8) -> bool:
    """Whether every byte of `snap` is what make_snapshot gives for its identity and tokens."""
    want = make_snapshot(snap.identity, snap.tokens, row_bytes, capacity, snap.logits is not None)
    return same(snap, want)


def same(a: Snapshot, b: Snapshot) -> bool:
    if (a.identity.key, a.length, a.tokens, a.token_hash, a.meta, a.kind) != (
            b.identity.key, b.length, b.tokens, b.token_hash, b.meta, b.kind):
        return False
    if set(a.caches) != set(b.caches) or any(not torch.equal(a.caches[n], b.caches[n]) for n in a.caches):
        return False
    if (a.logits is None) != (b.logits is None):
        return False
    return a.logits is None or torch.equal(a.logits, b.logits)


def continue_slot(session, slot: int, more: list[int]) -> list[torch.Tensor]:
    """A prefill chunk, then draft, verify, commit 5, draft, verify: every cache of the slot is read."""
    outs, length = [], session.seq_lens[slot]
    out = session.replay("prefill", token_ids=[more[:64]], slot_ids=[slot], positions=[length], new_tokens=[64])
    outs.append(out["logits"].clone())
    length += 64
    for accept in (5, None):
        outs.append(session.replay("draft", token_ids=[more[64:71]], slot_ids=[slot], positions=[length])["logits"].clone())
        outs.append(session.replay("verify", token_ids=[more[64:72]], slot_ids=[slot], positions=[length])["logits"].clone())
        if accept:
            session.replay("commit", slot_ids=[slot], positions=[length], accepted_tokens=[accept])
            length += accept
    return outs


def clone(snap: Snapshot) -> Snapshot:
    """A deep copy, to show later that the stored snapshot never changed."""
    logits = snap.logits.clone() if snap.logits is not None else None
    return Snapshot(snap.identity, snap.length, bytes(snap.tokens), snap.token_hash,
                    {n: t.clone() for n, t in snap.caches.items()}, dict(snap.meta), logits, snap.kind)
