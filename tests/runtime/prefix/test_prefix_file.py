"""The snapshot file: plain safetensors, and any damage to any byte is detected."""

from __future__ import annotations

import json

import pytest
import safetensors
import torch

from b12x_toolchain.runtime.prefix import snapshot_file
from b12x_toolchain.runtime.prefix.snapshot_file import (
    ChecksumMismatch,
    CorruptSnapshot,
    IdentityMismatch,
    SchemaMismatch,
)
from runtime.prefix.helpers import APPEND, fake_identity, make_snapshot, same


def _bytes(snap) -> bytearray:
    chunks, size = snapshot_file.encode(snap)
    data = bytearray(b"".join(bytes(c) for c in chunks))
    assert len(data) == size
    return data


def test_round_trip_and_plain_safetensors(tmp_path):
    ident = fake_identity()
    snap = make_snapshot(ident, list(range(1000, 1013)))
    data = _bytes(snap)
    back = snapshot_file.decode(bytearray(data), ident)
    assert same(back, snap) and back.nbytes == snap.nbytes

    path = tmp_path / "snap.safetensors"
    path.write_bytes(data)
    with safetensors.safe_open(str(path), "pt") as f:  # any safetensors reader can open it
        meta = json.loads(f.metadata()[snapshot_file.META_KEY])
        assert meta["length"] == 13 and meta["identity"]["key"] == ident.key
        assert f.get_tensor("tokens").tolist() == list(range(1000, 1013))
        assert torch.equal(f.get_tensor(APPEND), snap.caches[APPEND])
        assert torch.equal(f.get_tensor("logits"), snap.logits)


def test_empty_tensors_and_missing_logits_round_trip():
    ident = fake_identity()
    snap = make_snapshot(ident, [7], logits=False)  # one token: the append cache has no rows yet
    assert snap.caches[APPEND].shape == (0, 64)
    back = snapshot_file.decode(_bytes(snap), ident)
    assert same(back, snap) and back.logits is None


def test_every_flipped_byte_and_every_truncation_is_detected():
    ident = fake_identity()
    data = _bytes(make_snapshot(ident, list(range(40)), row_bytes=32))
    header_end = 8 + int.from_bytes(data[:8], "little")
    # Every byte of the length prefix and header, and a spread of payload bytes (tokens, logits, caches).
    positions = list(range(header_end)) + list(range(header_end, len(data), 7)) + [len(data) - 1]
    for pos in positions:
        broken = bytearray(data)
        broken[pos] ^= 0x01
        with pytest.raises((CorruptSnapshot, SchemaMismatch)):
            snapshot_file.decode(broken, ident)
    for cut in (0, 5, 8, header_end - 1, header_end, header_end + 3, len(data) - 1):
        with pytest.raises(CorruptSnapshot):
            snapshot_file.decode(bytearray(data[:cut]), ident)
    flipped = bytearray(data)
    flipped[-1] ^= 0x80
    with pytest.raises(ChecksumMismatch):
        snapshot_file.verify(flipped)


def test_header_padding_is_covered_too():
    """A space turned into a tab still parses as the same JSON; only the checksum sees it."""
    ident = fake_identity()
    for n in range(1, 9):  # some token count leaves padding after the header
        data = _bytes(make_snapshot(ident, list(range(n))))
        header_end = 8 + int.from_bytes(data[:8], "little")
        if data[header_end - 1] == ord(" "):
            break
    broken = bytearray(data)
    broken[header_end - 1] = ord("\t")
    json.loads(bytes(broken[8:header_end]))
    with pytest.raises(ChecksumMismatch):
        snapshot_file.decode(broken, ident)


def test_other_schema_and_other_identity_are_refused(monkeypatch):
    ident = fake_identity()
    snap = make_snapshot(ident, [1, 2, 3])
    with pytest.raises(IdentityMismatch):
        snapshot_file.decode(_bytes(snap), fake_identity("b"))
    monkeypatch.setattr(snapshot_file, "SNAPSHOT_SCHEMA", 99)
    stale = _bytes(snap)  # a sound file written by a runtime with another schema
    monkeypatch.undo()
    with pytest.raises(SchemaMismatch, match="schema 99"):
        snapshot_file.decode(stale, ident)
