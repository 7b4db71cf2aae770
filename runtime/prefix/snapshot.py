"""Prefix snapshots: one slot's whole cache state, captured and hydrated byte for byte.

Every cache of a slot is one of two kinds, both addressed by absolute position:

* ring — the window ring of every target layer and draft stage (row = pos % capacity),
  the compressor state rings (row = pos % span) and a draft stage's last streams (one
  row). After `length` tokens the
  rows holding positions max(0, length - capacity) .. length - 1 are live; they are
  stored in physical order with the ring index (length % capacity) and the absolute
  offset (length), which is all it takes to put them back where the ring expects them.
* paged — compressed entries and index keys, in the session's pages (entry = pos //
  ratio, written when a group closes; entries 0 .. length // ratio - 1 are live). A
  snapshot holds the pages that cover its tokens, ceil(length / tokens_per_page) per
  pool, either by reference (L1: the session's pages themselves, retained, shared with
  every slot hydrated from it, never written again since a writer copies a shared page
  first) or as whole pages of bytes (L2, another session), dead records zeroed so no
  stale byte of an earlier request is ever stored.

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

import dataclasses
from dataclasses import dataclass

import torch

from b12x_toolchain.runtime.errors import LayoutError, SnapshotError  # noqa: F401  (re-exported)
from b12x_toolchain.runtime.package.kinds import KINDS, TOKEN_BYTES
from b12x_toolchain.runtime.prefix.keys import Identity, package_identity, token_bytes, token_hash, token_ids

# Attention window rings: the rotating caches of the capability flags.
WINDOW_KINDS = ("window_ring", "draft_window")


class SnapshotMismatch(SnapshotError):
    """The snapshot was made for another package or does not fit this layout."""


@dataclass(frozen=True)
class CacheKind:
    name: str
    kind: str  # "ring" or "paged"
    capacity: int  # rows per slot (rings)
    row_bytes: int  # ring rows; paged: one record
    ratio: int = 1  # paged caches: one entry per `ratio` positions
    window: bool = False  # an attention window ring (a rotating cache, in the capability flags)
    pool: str | None = None  # paged caches
    tokens_per_page: int = 0
    page_bytes: int = 0

    def rows(self, length: int) -> int:
        return min(length, self.capacity) if self.kind == "ring" else length // self.ratio

    def pages(self, length: int) -> int:
        return -(-length // self.tokens_per_page)

    def meta(self, length: int) -> dict:
        """What a snapshot of `length` tokens records for this cache."""
        out = {"kind": self.kind, "row_bytes": self.row_bytes, "rows": self.rows(length), "offset": length}
        if self.kind == "ring":
            out.update(capacity=self.capacity, ring_index=length % self.capacity)
        else:
            out.update(ratio=self.ratio, pool=self.pool, tokens_per_page=self.tokens_per_page,
                       page_bytes=self.page_bytes, pages=self.pages(length))
        return out

    def shape(self, length: int) -> tuple[int, int]:
        """The stored tensor: live ring rows, or whole pages."""
        return (self.rows(length), self.row_bytes) if self.kind == "ring" else (self.pages(length), self.page_bytes)


class SharedPages:
    """A snapshot's reference to a session's pages: retained at capture, released once."""

    def __init__(self, tables, ids: dict[str, tuple[int, ...]]):
        self.tables, self.ids = tables, ids
        self.released = False

    def release(self, evicted: bool = True) -> None:
        if not self.released:
            self.released = True
            self.tables.release(self.ids, evicted)


def _classify(spec, max_seq_len: int) -> CacheKind:
    """How the codec stores one cache, from its recorded kind, ratio and rows — never its name."""
    info = spec.info
    kind = KINDS.get(info.kind) if info is not None else None
    if kind is None or kind.role != "cache" or kind.rows not in ("ring", "append"):
        raise LayoutError(f"{spec.name}: the snapshot codec does not know cache kind {getattr(info, 'kind', None)!r}")
    if kind.pool is not None:
        page = info.page
        if spec.shape != (page.pool, page.page_bytes) or page.pages_per_slot * page.tokens_per_page < max_seq_len:
            raise LayoutError(f"{spec.name}: expected uint8 [{page.pool}, {page.page_bytes}] whose pages cover "
                              f"max_seq_len {max_seq_len}, got {list(spec.shape)}")
        return CacheKind(spec.name, "paged", 0, page.record_bytes, ratio=info.ratio, pool=page.pool,
                         tokens_per_page=page.tokens_per_page, page_bytes=page.page_bytes)
    if spec.dtype != "uint8" or len(spec.shape) != 3 or spec.shape[0] != "slots":
        raise LayoutError(f"{spec.name}: expected uint8 [slots, rows, bytes], got {spec.dtype} {list(spec.shape)}")
    if kind.rows != "ring":
        raise LayoutError(f"{spec.name}: a per-slot {info.kind} cache; this codec stores those kinds paged")
    return CacheKind(spec.name, "ring", spec.shape[1], spec.shape[2], window=info.kind in WINDOW_KINDS)


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
    return package.caches


def package_layout(package) -> dict[str, CacheKind]:
    return cache_layout(cache_specs(package), package.manifest.model.max_seq_len)


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
    """Immutable once made: tiers hand out the object itself, hydration only reads it.

    `caches` holds every ring's live rows and, unless `pages` holds them by reference,
    every paged cache's whole pages [pages, page_bytes].
    """

    identity: Identity
    length: int
    tokens: bytes  # int32 little-endian, `length` ids
    token_hash: str
    caches: dict  # name -> uint8 tensor on the CPU (CacheKind.shape)
    meta: dict  # name -> CacheKind.meta(length)
    logits: torch.Tensor | None = None  # float32 [vocab] after the last token
    kind: str = "prefill"
    pages: SharedPages | None = None  # paged caches by reference to a session's pages

    @property
    def nbytes(self) -> int:
        """Bytes the snapshot holds, pages held by reference included (they stay allocated)."""
        logits = self.logits.nbytes if self.logits is not None else 0
        shared = sum(m["pages"] * m["page_bytes"] for m in self.meta.values() if m["kind"] == "paged") \
            if self.pages is not None else 0
        return sum(t.nbytes for t in self.caches.values()) + len(self.tokens) + logits + shared

    @property
    def token_ids(self) -> list[int]:
        return token_ids(self.tokens)

    def release(self) -> None:
        """Drop the snapshot's page references (a tier evicted it); it can no longer be hydrated."""
        if self.pages is not None:
            self.pages.release()


class SnapshotCodec:
    """Captures and hydrates slots of sessions of one package."""

    def __init__(self, package):
        self.package = package
        self.identity = package_identity(package)
        self.layout = package_layout(package)
        self.seq_len = seq_len_buffer(cache_specs(package))
        self.max_seq_len = package.manifest.model.max_seq_len
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

    def capture(self, session, slot: int, tokens, logits: torch.Tensor | None = None,
                by_reference: bool = False) -> Snapshot:
        """Copy the live rows of `slot`, which must hold exactly `tokens`, into a new snapshot.

        by_reference: retain the slot's pages instead of copying them (see the module doc).
        """
        self._check_session(session, slot)
        data = token_bytes(tokens)
        length = len(data) // TOKEN_BYTES
        stored = int(session.caches[self.seq_len][slot])
        if not 1 <= length == session.seq_lens[slot] == stored:
            raise SnapshotError(f"slot {slot} holds {session.seq_lens[slot]} committed tokens "
                                f"({self.seq_len} {stored}); {length} tokens were given")
        caches = {}
        for name, kind in self.layout.items():
            if kind.kind == "ring":
                # copy=True: a CPU cache would otherwise be shared, and the slot moves on.
                caches[name] = session.caches[name][slot, : kind.rows(length)].to("cpu", copy=True).contiguous()
        pages = SharedPages(session.pages, session.pages.share(slot, length)) if by_reference else None
        if pages is None:
            held = {pool: session.pages.held[pool][slot] for pool in session.pages.pools}
            caches.update(self._page_bytes(session.pages, held, length))
        if logits is not None:
            logits = logits.detach().to("cpu", torch.float32, copy=True).contiguous()
        meta = {name: kind.meta(length) for name, kind in self.layout.items()}
        return Snapshot(self.identity, length, data, token_hash(self.identity.key, data), caches, meta, logits,
                        pages=pages)

    def _page_bytes(self, tables, held: dict, length: int) -> dict:
        """Whole pages of every paged cache as CPU bytes, records past the live entries zeroed."""
        out = {}
        for name, kind in self.layout.items():
            if kind.kind != "paged":
                continue
            cache = tables.caches[kind.pool][name]
            ids = torch.tensor(held[kind.pool][: kind.pages(length)], dtype=torch.long, device=cache.device)
            pages = cache[ids].to("cpu", copy=True).contiguous()
            records = pages.view(-1, kind.row_bytes)
            records[kind.rows(length):] = 0
            out[name] = pages
        return out

    def materialized(self, snap: Snapshot) -> Snapshot:
        """`snap` with its pages as bytes (for L2, or a session that does not hold them)."""
        if snap.pages is None:
            return snap
        if snap.pages.released:
            raise SnapshotError("the snapshot's pages were released; it cannot be read")
        held = {p: list(ids) for p, ids in snap.pages.ids.items()}
        caches = {**snap.caches, **self._page_bytes(snap.pages.tables, held, snap.length)}
        return dataclasses.replace(snap, caches=caches, pages=None)

    def check(self, snap: Snapshot) -> None:
        """Raise SnapshotMismatch unless `snap` fits this package exactly."""
        if snap.identity.key != self.identity.key or snap.identity.fields != self.identity.fields:
            raise SnapshotMismatch("snapshot was made for another package (recipe, weights, op set or cache formats)")
        if not 1 <= snap.length <= self.max_seq_len or len(snap.tokens) != TOKEN_BYTES * snap.length:
            raise SnapshotMismatch(f"snapshot length {snap.length} does not fit max_seq_len {self.max_seq_len} "
                                   f"or its {len(snap.tokens) // TOKEN_BYTES} tokens")
        by_reference = snap.pages is not None
        if by_reference and snap.pages.released:
            raise SnapshotError("the snapshot's pages were released; it cannot be hydrated")
        stored = {n for n, k in self.layout.items() if k.kind == "ring" or not by_reference}
        differ = sorted((stored ^ set(snap.caches)) | (set(self.layout) ^ set(snap.meta)))
        if differ:
            raise SnapshotMismatch(f"snapshot caches differ from the package's: {differ[:3]}")
        for name, kind in self.layout.items():
            expected = kind.meta(snap.length)
            if snap.meta[name] != expected:
                raise SnapshotMismatch(f"{name}: snapshot records {snap.meta[name]}, expected {expected}")
            if name not in stored:
                if len(snap.pages.ids.get(kind.pool, ())) != expected["pages"]:
                    raise SnapshotMismatch(f"{name}: the snapshot holds {len(snap.pages.ids.get(kind.pool, ()))} "
                                           f"pages of pool {kind.pool}, expected {expected['pages']}")
                continue
            tensor, shape = snap.caches[name], kind.shape(snap.length)
            if tensor.dtype != torch.uint8 or tuple(tensor.shape) != shape:
                raise SnapshotMismatch(f"{name}: snapshot rows are {tensor.dtype} {list(tensor.shape)}, "
                                       f"expected uint8 {list(shape)}")

    def hydrate(self, session, slot: int, snap: Snapshot) -> None:
        """Make `slot` hold exactly the snapshot's state; everything is checked before any write.

        Pages held by reference in this session are shared, not copied: only the rings
        (window, compressor state, drafter caches) are written.
        """
        self._check_session(session, slot)
        self.check(snap)
        if snap.pages is not None and snap.pages.tables is not session.pages:
            snap = self.materialized(snap)
        session.reset_slot(slot)
        if snap.pages is not None:
            session.pages.adopt(slot, snap.pages.ids)
        else:  # raises before writing when the pages cannot be had; the slot stays empty
            by_pool = {}
            for name, kind in self.layout.items():
                if kind.kind == "paged":
                    by_pool.setdefault(kind.pool, {})[name] = snap.caches[name].to(session.device)
            session.pages.fill(slot, by_pool)
        for name, kind in self.layout.items():
            if kind.kind == "ring":
                session.caches[name][slot, : kind.rows(snap.length)].copy_(snap.caches[name])
        session.set_committed_length(slot, snap.length)
