"""Snapshot codec: a hydrated slot continues bit for bit like the slot it was taken from.

On the suite's small package (a window-only and a ratio-2 layer, one draft stage), which has
every cache kind; test_codec_by_kind covers the tiny recipe's whole layout (ratio-1 layers,
an entry pool shared by two ratios) at the codec's level."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.prefix.keys import token_bytes
from b12x_toolchain.runtime.prefix.l1 import L1Cache
from b12x_toolchain.runtime.prefix.l2 import L2Store
from b12x_toolchain.runtime.prefix.snapshot import (
    LayoutError,
    SnapshotCodec,
    SnapshotError,
    SnapshotMismatch,
    cache_layout,
    cache_specs,
    capabilities,
    package_layout,
)
from b12x_toolchain.runtime.serving.speculative import Decoder
from conftest import random_tokens
from runtime.prefix.helpers import clone, continue_slot, same

# Before the window fills (odd, so a ratio-2 group is open), exactly at the window, after the ring wrapped.
LENGTHS = (101, 128, 301)


@pytest.fixture(scope="module")
def session(small_pkg):
    return small_pkg.session(slots=4, max_rows=1)  # slots 0..3; the 5th is the scratch slot


@pytest.mark.parametrize("length", LENGTHS)
def test_hydrated_slot_continues_bitwise(small_pkg, session, length, tmp_path):
    """Directly, through L1, and through an L2 file read back after a restart of the store."""
    gen = torch.Generator().manual_seed(length)
    prompt, more, other = random_tokens(gen, length), random_tokens(gen, 80), random_tokens(gen, 260)
    codec = SnapshotCodec(small_pkg)
    decoder = Decoder(session)
    for slot in (1, 2, 3):  # the targets hold a longer, unrelated request first
        decoder.prefill(slot, other)
    decoder.prefill(0, prompt)
    snap = codec.capture(session, 0, prompt)

    window, compressed = snap.meta["cache.layer0.window"], snap.meta["cache.layer1.compressed"]
    assert window == {"kind": "ring", "capacity": 128, "row_bytes": 66, "rows": min(length, 128),
                      "ring_index": length % 128, "offset": length}
    pages = -(-length // 64)  # whole 64-token pages of 32 ratio-2 records of 36 bytes
    assert compressed == {"kind": "paged", "ratio": 2, "row_bytes": 36, "rows": length // 2, "offset": length,
                          "pool": "entry_pages", "tokens_per_page": 64, "page_bytes": 32 * 36, "pages": pages}
    index = snap.meta["cache.layer1.index"]  # the other pool: 32-token pages
    assert (index["pool"], index["rows"], index["pages"]) == ("index_key_pages", length // 2, -(-length // 32))
    assert snap.meta["cache.layer1.state"]["ring_index"] == length % 2
    assert set(snap.caches) == set(codec.layout)  # every cache but the committed length, the draft ring included
    for name, rows in snap.caches.items():
        kind = codec.layout[name]
        if kind.kind == "ring":
            assert torch.equal(rows, session.caches[name][0, : rows.shape[0]]), name
            continue
        held = session.pages.held[kind.pool][0][: kind.pages(length)]
        records, stored = session.caches[name][held].view(-1, kind.row_bytes), rows.view(-1, kind.row_bytes)
        live = kind.rows(length)
        assert torch.equal(stored[:live], records[:live]) and not stored[live:].any(), name  # dead records zeroed
    kept = clone(snap)

    l1 = L1Cache(1 << 30)
    l1.insert(snap)
    with L2Store(tmp_path, 1 << 30) as store:
        store.put(snap)
    with L2Store(tmp_path, 1 << 30) as store:
        from_disk = store.lookup(codec.identity, token_bytes(prompt + more))
    codec.hydrate(session, 1, snap)
    codec.hydrate(session, 2, l1.lookup(codec.identity.key, token_bytes(prompt + more)))
    codec.hydrate(session, 3, from_disk)
    assert session.seq_lens[1:4] == [length] * 3 and session.caches["cache.seq_len"][1:4].tolist() == [length] * 3
    want = continue_slot(session, 0, more)
    for slot, path in ((1, "direct"), (2, "L1"), (3, "L2")):
        got = continue_slot(session, slot, more)
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"{path}: output {i} differs after hydration"

    # Every slot moved on, and a hydrated one is now overwritten outright: the snapshot is untouched.
    for cache in session.caches.values():
        cache[1] = 0x5A if cache.dtype == torch.uint8 else 7
    assert same(snap, kept)
    codec.hydrate(session, 1, snap)
    again = continue_slot(session, 1, more)
    assert all(torch.equal(a, b) for a, b in zip(want, again))


def _slot_state(session, slot):
    return [session.seq_lens[slot]] + [c[slot].clone() for c in session.caches.values()]


def test_hydrate_refuses_another_package_before_writing(small_pkg, other_weights_pkg, session):
    gen = torch.Generator().manual_seed(5)
    prompt = random_tokens(gen, 70)
    Decoder(session).prefill(0, prompt)
    snap = SnapshotCodec(small_pkg).capture(session, 0, prompt)
    # The same recipe and cache layout with other weights: only the package's identity tells them apart.
    other_session = other_weights_pkg.session(slots=1, max_rows=1)
    Decoder(other_session).prefill(0, prompt[:10])
    before = _slot_state(other_session, 0)
    with pytest.raises(SnapshotMismatch, match="another package"):
        SnapshotCodec(other_weights_pkg).hydrate(other_session, 0, snap)
    with pytest.raises(SnapshotMismatch, match="another package"):
        SnapshotCodec(small_pkg).hydrate(other_session, 0, snap)
    after = _slot_state(other_session, 0)
    assert before[0] == after[0] and all(torch.equal(a, b) for a, b in zip(before[1:], after[1:]))


def test_hydrate_refuses_records_that_do_not_fit_the_layout(small_pkg, session):
    gen = torch.Generator().manual_seed(6)
    prompt = random_tokens(gen, 130)
    codec = SnapshotCodec(small_pkg)
    Decoder(session).prefill(0, prompt)
    snap = codec.capture(session, 0, prompt)
    Decoder(session).prefill(3, prompt[:3])
    before = _slot_state(session, 3)
    bad_meta = {**snap.meta, "cache.layer0.window": {**snap.meta["cache.layer0.window"], "ring_index": 0}}
    bad_rows = {**snap.caches, "cache.layer1.compressed": snap.caches["cache.layer1.compressed"][:-1]}
    missing = {k: v for k, v in snap.caches.items() if k != "cache.draft0.window"}
    for label, broken in (("ring index", {"meta": bad_meta}), ("row count", {"caches": bad_rows}),
                          ("missing draft ring", {"caches": missing})):
        fields = {**snap.__dict__, **broken}
        with pytest.raises(SnapshotMismatch):
            codec.hydrate(session, 3, type(snap)(**fields))
    after = _slot_state(session, 3)
    assert before[0] == after[0] and all(torch.equal(a, b) for a, b in zip(before[1:], after[1:]))


def test_capture_needs_the_slot_to_hold_exactly_the_tokens(small_pkg, session):
    Decoder(session).prefill(0, [1, 2, 3, 4])
    codec = SnapshotCodec(small_pkg)
    with pytest.raises(SnapshotError, match="4 committed tokens"):
        codec.capture(session, 0, [1, 2, 3])
    with pytest.raises(SnapshotError, match="out of range"):
        codec.capture(session, 4, [1, 2, 3, 4])  # the scratch slot belongs to no request


def test_every_cache_kind_is_covered_and_unknown_caches_turn_snapshots_off(small_pkg):
    layout = package_layout(small_pkg)
    kinds = {name: (k.kind, k.window) for name, k in layout.items()}
    assert set(kinds) == {s.name for s in cache_specs(small_pkg)} - {"cache.seq_len"}
    assert kinds["cache.layer0.window"] == ("ring", True) and kinds["cache.draft0.window"] == ("ring", True)
    assert kinds["cache.layer1.state"] == ("ring", False) and kinds["cache.layer1.compressed"] == ("paged", False)
    assert kinds["cache.layer1.index"] == ("paged", False) and kinds["cache.engram.history"] == ("ring", False)
    assert layout["cache.layer1.index"].pool == "index_key_pages" and layout["cache.layer1.index"].tokens_per_page == 32
    assert "cache.layer0.compressed" not in kinds  # a window-only layer owns only its window
    assert small_pkg.manifest.model.capabilities == {"supports_prefix_snapshot": True,
                                                     "supports_rotating_cache_snapshot": True}
    known = [s for s in cache_specs(small_pkg) if s.name in ("cache.layer0.window", "cache.seq_len")]
    specs = known + [BufferSpec("cache.layer0.index_keys", "cache", "uint8", ("slots", 512, 68))]  # no kind recorded
    with pytest.raises(LayoutError, match="cache.layer0.index_keys"):
        cache_layout(specs, 1024)
    assert capabilities(specs, 1024) == {"supports_prefix_snapshot": False,
                                         "supports_rotating_cache_snapshot": False}
    assert capabilities(known, 1024)["supports_prefix_snapshot"]
