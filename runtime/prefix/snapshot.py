"""Prefix snapshots: one slot's whole cache state, captured and hydrated byte for byte.

Every cache of a slot is one of two kinds, both addressed by absolute position:

* ring — the window ring of every target layer and draft stage (row = pos % capacity),
  the compressor state rings (row = pos % span) and a draft stage's last streams (one
  row). After `length` tokens the
  rows holding positions max(0, length - capacity) .. length - 1 are live; they are
  stored in physical order with the ring index (length % capacity) and the absolute
  offset (length), which is all it takes to put them back where the ring expects them.
* append — compressed rows (row = pos // ratio, written when a group closes); rows
  0 .. length // ratio - 1 are live.

Rows past those are invisible to every pass (positions are masked), so they are neither
stored nor cleared. Rows stay in their encoded formats (MXFP8, NVFP4, fp32 bytes): a
snapshot never decodes, so hydration cannot round differently from the original. The
committed length is the snapshot's length; the logits after the last token ride along,
so a request whose prompt is exactly the snapshot gets its first token without a replay.

What a cache is comes from the manifest's buffer data (kind, ratio, rows per slot;
runtime/package/contract.py), never from its name: a ring kind is stored as a ring, an
entry kind as an append cache, the seq_len kind is the committed length.

A snapshot carries the identity of the package it came from (prefix_keys.py); hydration
refuses any other package, and refuses a snapshot whose per-cache metadata does not say
exactly what this package's layout expects for its length. A package with a cache the
codec does not know cannot be snapshotted at all (LayoutError), rather than half-saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from b12x_toolchain.runtime.package.kinds import KINDS
from b12x_toolchain.runtime.prefix.keys import Identity, package_identity, token_bytes, token_hash, token_ids
from b12x_toolchain.runtime.errors import SnapshotError, LayoutError  # noqa: F401  (re-exported)

# Attention window rings: the rotating caches of the capability flags.
WINDOW_KINDS = ("window_ring", "draft_window")


class SnapshotMismatch(SnapshotError):
    """The snapshot was made for another package or does not fit this layout."""


@dataclass(frozen=True)
class CacheKind:
    name: str
    kind: str  # "ring" or "append"
    capacity: int  # rows per slot
    row_bytes: int
    ratio: int = 1  # append caches: one row per `ratio` positions
    window: bool = False  # an attention window ring (a rotating cache, in the capability flags)

    def rows(self, length: int) -> int:
        return min(length, self.capacity) if self.kind == "ring" else length // self.ratio

    def meta(self, length: int) -> dict:
        """What a snapshot of `length` tokens records for this cache."""
        out = {"kind": self.kind, "row_bytes": self.row_bytes, "rows": self.rows(length), "offset": length}
        if self.kind == "ring":
            out.update(capacity=self.capacity, ring_index=length % self.capacity)
        else:
            out.update(ratio=self.ratio)
        return out


def _classify(spec, max_seq_len: int) -> CacheKind:
    """How the codec stores one cache, from its recorded kind, ratio and rows — never its name."""
    info = spec.info
    kind = KINDS.get(info.kind) if info is not None else None
    if kind is None or kind.role != "cache" or kind.rows not in ("ring", "append"):
        raise LayoutError(f"{spec.name}: the snapshot codec does not know cache kind {getattr(info, 'kind', None)!r}")
    if spec.dtype != "uint8" or len(spec.shape) != 3 or spec.shape[0] != "slots":
        raise LayoutError(f"{spec.name}: expected uint8 [slots, rows, bytes], got {spec.dtype} {list(spec.shape)}")
    capacity, row_bytes = spec.shape[1], spec.shape[2]
    if kind.rows == "ring":
        return CacheKind(spec.name, "ring", capacity, row_bytes, window=info.kind in WINDOW_KINDS)
    if capacity != max_seq_len // info.ratio:
        raise LayoutError(f"{spec.name}: {capacity} rows of one per {info.ratio} positions do not cover "
                          f"max_seq_len {max_seq_len}")
    return CacheKind(spec.name, "append", capacity, row_bytes, ratio=info.ratio)


def seq_len_buffer(specs) -> str:
    """The name of the one cache that holds each slot's committed length."""
    names = [s.name for s in specs if s.info is not None and s.info.kind == "seq_len"]
    if len(names) != 1:
        raise LayoutError(f"expected one seq_len cache, found {names}")
    return names[0]


def cache_layout(specs, max_seq_len: int) -> dict[str, CacheKind]:
    """Classify every cache buffer (BufferSpecs with role "cache" and their info) but the
    committed length; one the codec does not know raises LayoutError."""
    seq_len = seq_len_buffer(specs)
    return {spec.name: _classify(spec, max_seq_len) for spec in specs if spec.name != seq_len}


def cache_specs(package) -> list:
    specs = {}
    for info in package.passes.values():
        for spec in info.inputs:
            if spec.role == "cache":
                specs[spec.name] = spec
    return [specs[name] for name in sorted(specs)]


def package_layout(package) -> dict[str, CacheKind]:
    return cache_layout(cache_specs(package), package.manifest["model"]["max_seq_len"])


def capabilities(specs, max_seq_len: int) -> dict[str, bool]:
    """The manifest's snapshot flags: on exactly when the codec covers every cache."""
    try:
        cache_layout(specs, max_seq_len)
        ok = True
    except LayoutError:
        ok = False
    return {"supports_prefix_snapshot": ok, "supports_rotating_cache_snapshot": ok}


@dataclass(frozen=True, eq=False)
class Snapshot:
    """Immutable once made: tiers hand out the object itself, hydration only reads it."""

    identity: Identity
    length: int
    tokens: bytes  # int32 little-endian, `length` ids
    token_hash: str
    caches: dict  # name -> uint8 [rows, row_bytes] on the CPU
    meta: dict  # name -> CacheKind.meta(length)
    logits: torch.Tensor | None = None  # float32 [vocab] after the last token
    kind: str = "prefill"

    @property
    def nbytes(self) -> int:
        logits = self.logits.nbytes if self.logits is not None else 0
        return sum(t.nbytes for t in self.caches.values()) + len(self.tokens) + logits

    @property
    def token_ids(self) -> list[int]:
        return token_ids(self.tokens)


class SnapshotCodec:
    """Captures and hydrates slots of sessions of one package."""

    def __init__(self, package):
        self.package = package
        self.identity = package_identity(package)
        self.layout = package_layout(package)
        self.seq_len = seq_len_buffer(cache_specs(package))
        self.max_seq_len = package.manifest["model"]["max_seq_len"]
        windows = [k.capacity for k in self.layout.values() if k.window]
        self.window_capacity = min(windows) if windows else None

    def wrapped(self, length: int) -> bool:
        """Whether a snapshot of `length` tokens holds a window ring that has wrapped."""
        return self.window_capacity is not None and length > self.window_capacity

    def _check_session(self, session, slot: int) -> None:
        if session.package is not self.package and package_identity(session.package).key != self.identity.key:
            raise SnapshotMismatch("the session runs another package than this codec was made for")
        if not 0 <= slot < session.slots:
            raise SnapshotError(f"slot {slot} is out of range [0, {session.slots})")

    def capture(self, session, slot: int, tokens, logits: torch.Tensor | None = None) -> Snapshot:
        """Copy the live rows of `slot`, which must hold exactly `tokens`, into a new snapshot."""
        self._check_session(session, slot)
        data = token_bytes(tokens)
        length = len(data) // 4
        stored = int(session.caches[self.seq_len][slot])
        if not 1 <= length == session.seq_lens[slot] == stored:
            raise SnapshotError(f"slot {slot} holds {session.seq_lens[slot]} committed tokens "
                                f"({self.seq_len} {stored}); {length} tokens were given")
        caches = {}
        for name, kind in self.layout.items():
            rows = session.caches[name][slot, : kind.rows(length)]
            # copy=True: a CPU cache would otherwise be shared, and the slot moves on.
            caches[name] = rows.to("cpu", copy=True).contiguous()
        if logits is not None:
            logits = logits.detach().to("cpu", torch.float32, copy=True).contiguous()
        meta = {name: kind.meta(length) for name, kind in self.layout.items()}
        return Snapshot(self.identity, length, data, token_hash(self.identity.key, data), caches, meta, logits)

    def check(self, snap: Snapshot) -> None:
        """Raise SnapshotMismatch unless `snap` fits this package exactly."""
        if snap.identity.key != self.identity.key or snap.identity.fields != self.identity.fields:
            raise SnapshotMismatch("snapshot was made for another package (recipe, weights, op set or cache formats)")
        if not 1 <= snap.length <= self.max_seq_len or len(snap.tokens) != 4 * snap.length:
            raise SnapshotMismatch(f"snapshot length {snap.length} does not fit max_seq_len {self.max_seq_len} "
                                   f"or its {len(snap.tokens) // 4} tokens")
        differ = sorted((set(self.layout) ^ set(snap.caches)) | (set(self.layout) ^ set(snap.meta)))
        if differ:
            raise SnapshotMismatch(f"snapshot caches differ from the package's: {differ[:3]}")
        for name, kind in self.layout.items():
            expected = kind.meta(snap.length)
            if snap.meta[name] != expected:
                raise SnapshotMismatch(f"{name}: snapshot records {snap.meta[name]}, expected {expected}")
            tensor = snap.caches[name]
            if tensor.dtype != torch.uint8 or tuple(tensor.shape) != (expected["rows"], kind.row_bytes):
                raise SnapshotMismatch(f"{name}: snapshot rows are {tensor.dtype} {list(tensor.shape)}, "
                                       f"expected uint8 {[expected['rows'], kind.row_bytes]}")

    def hydrate(self, session, slot: int, snap: Snapshot) -> None:
        """Make `slot` hold exactly the snapshot's state; everything is checked before any write."""
        self._check_session(session, slot)
        self.check(snap)
        session.reset_slot(slot)
        for name, kind in self.layout.items():
            session.caches[name][slot, : kind.rows(snap.length)].copy_(snap.caches[name])
        session.caches[self.seq_len][slot] = snap.length
        session.seq_lens[slot] = snap.length
