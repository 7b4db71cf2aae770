"""A snapshot as one safetensors file, with a checksum over every byte that matters.

Layout (plain safetensors, readable by `safetensors.safe_open`):

    u64 header length | header JSON (space-padded to 8) | tensor data

The header's `__metadata__` holds `b12x.snapshot` (JSON: schema, identity, length, token
hash, kind, per-cache metadata) and `b12x.checksum`: the sha256 (hex) of the length prefix,
the header with the checksum's 64 digits replaced by zeros, and the sha256 digests of the
data section's 4 MiB chunks, in order. So a flipped bit anywhere — payload, tensor table,
token ids, even header padding — fails the check (a checksum over the payload alone would
let a damaged header point at the wrong bytes), and a reader can hash the chunks on several
threads while it is still reading later ones.
Tensors: `logits` (F32, optional), `tokens` (I32) and one U8 tensor per cache, in that
order, so every tensor starts aligned for its dtype. Decoding is zero-copy: the tensors
are views of the buffer that was read.

Both JSON texts (the header and the snapshot record in it) are read strictly
(runtime/strict_json.py): a duplicated key or a NaN makes the file damaged, as a reader
that kept the other duplicate would see another snapshot. A checksum does not settle it:
anyone who can write the directory can recompute one.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

from b12x_toolchain.runtime import strict_json
from b12x_toolchain.runtime.package.kinds import TOKEN_BYTES
from b12x_toolchain.runtime.prefix.keys import SNAPSHOT_SCHEMA, Identity, token_hash
from b12x_toolchain.runtime.prefix.snapshot import Snapshot

CHECKSUM_KEY = "b12x.checksum"
META_KEY = "b12x.snapshot"
_ZEROS = "0" * 64
_DTYPES = {"U8": (torch.uint8, 1), "I32": (torch.int32, 4), "F32": (torch.float32, 4)}
_NAMES = {torch.uint8: "U8", torch.int32: "I32", torch.float32: "F32"}
HEADER_LIMIT = 16 << 20
CHECKSUM_CHUNK = 4 << 20


class CorruptSnapshot(ValueError):
    """The file is not a well-formed snapshot (truncated, bad header, wrong sizes)."""


class ChecksumMismatch(CorruptSnapshot):
    pass


class SchemaMismatch(ValueError):
    """A well-formed snapshot of another schema version: stale, never loaded."""


class IdentityMismatch(ValueError):
    """A sound snapshot made for another package."""


def chunk_digest(piece) -> bytes:
    return hashlib.sha256(piece).digest()


def chunk_digests(data, pool=None) -> bytes:
    """Digests of the CHECKSUM_CHUNK pieces of a contiguous data section (hashed on `pool` if given)."""
    view = memoryview(data)
    pieces = [view[i : i + CHECKSUM_CHUNK] for i in range(0, len(view), CHECKSUM_CHUNK)]
    if pool is None or len(pieces) < 2:
        return b"".join(map(chunk_digest, pieces))
    return b"".join(pool.map(chunk_digest, pieces))


def _stream_digests(buffers) -> bytes:
    """chunk_digests of the concatenation of `buffers`, without concatenating them."""
    out, h, filled = [], hashlib.sha256(), 0
    for buf in buffers:
        view, pos = memoryview(buf).cast("B"), 0
        while pos < len(view):
            take = min(CHECKSUM_CHUNK - filled, len(view) - pos)
            h.update(view[pos : pos + take])
            pos, filled = pos + take, filled + take
            if filled == CHECKSUM_CHUNK:
                out.append(h.digest())
                h, filled = hashlib.sha256(), 0
    if filled:
        out.append(h.digest())
    return b"".join(out)


def _field(checksum: str) -> bytes:
    return f'"{CHECKSUM_KEY}":"{checksum}"'.encode()


def _header(tensors: list[tuple[str, torch.Tensor]], meta: dict, checksum: str) -> bytes:
    table, offset = {}, 0
    for name, tensor in tensors:
        table[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    metadata = {CHECKSUM_KEY: checksum,
                META_KEY: json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False)}
    text = json.dumps({"__metadata__": metadata, **table}, separators=(",", ":"), allow_nan=False).encode()
    return text + b" " * (-len(text) % 8)


def encode(snap: Snapshot) -> tuple[list, int]:
    """(buffers to write in order, total size); the buffers view the snapshot's own tensors."""
    meta = {"schema": SNAPSHOT_SCHEMA, "identity": snap.identity.to_json(), "length": snap.length,
            "token_hash": snap.token_hash, "kind": snap.kind, "caches": snap.meta}
    tensors = []
    if snap.logits is not None:
        tensors.append(("logits", snap.logits))
    tensors.append(("tokens", torch.frombuffer(bytearray(snap.tokens), dtype=torch.int32)))
    tensors += [(name, snap.caches[name]) for name in sorted(snap.caches)]
    header = _header(tensors, meta, _ZEROS)
    data = [t.contiguous().numpy().data.cast("B") for _, t in tensors if t.nbytes]
    prefix = struct.pack("<Q", len(header))
    digest = hashlib.sha256(prefix + header + _stream_digests(data)).hexdigest()
    header = header.replace(_field(_ZEROS), _field(digest), 1)
    return [prefix, header, *data], len(prefix) + len(header) + sum(b.nbytes for b in data)


def _parse_header(buf) -> tuple[int, dict]:
    if len(buf) < 8:
        raise CorruptSnapshot(f"file is {len(buf)} bytes; a snapshot has at least an 8-byte header length")
    (size,) = struct.unpack_from("<Q", buf, 0)
    if size > min(HEADER_LIMIT, len(buf) - 8):
        raise CorruptSnapshot(f"header length {size} exceeds the file ({len(buf)} bytes)")
    try:
        header = strict_json.loads(bytes(buf[8 : 8 + size]))
    except strict_json.StrictJsonError as exc:
        raise CorruptSnapshot(f"header is not strict JSON ({exc})") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise CorruptSnapshot("header has no __metadata__ object")
    return size, header


def _tensor_table(header: dict, data_size: int) -> dict[str, tuple]:
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, itemsize = _DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CorruptSnapshot(f"tensor {name!r}: bad dtype, shape or data_offsets") from None
        count = 1
        for d in shape:
            if d < 0:
                raise CorruptSnapshot(f"tensor {name!r}: negative dimension")
            count *= d
        if end - start != count * itemsize:
            raise CorruptSnapshot(f"tensor {name!r}: {end - start} bytes for shape {shape}")
        entries.append((start, end, name, dtype, shape, count))
    entries.sort(key=lambda e: (e[0], e[1]))
    position = 0
    for start, end, name, *_ in entries:
        if start != position:
            raise CorruptSnapshot(f"tensor {name!r} starts at {start}, expected {position}: holes or overlaps")
        position = end
    if position != data_size:
        raise CorruptSnapshot(f"tensors cover {position} bytes of a {data_size}-byte data section (truncated?)")
    return {name: (start, dtype, shape, count) for start, _, name, dtype, shape, count in entries}


def data_start(prefix, file_size: int) -> int | None:
    """Where the data section starts, from the first 8 bytes; None if they cannot be right."""
    if len(prefix) < 8:
        return None
    (size,) = struct.unpack_from("<Q", prefix, 0)
    return 8 + size if size <= min(HEADER_LIMIT, file_size - 8) else None


def verify(buf, digests: bytes | None = None, pool=None) -> dict:
    """Check structure and checksum of a whole file's bytes; returns the snapshot metadata.

    `digests` are the data chunks' digests when the reader already computed them while
    reading. Raises CorruptSnapshot / ChecksumMismatch for damaged files, SchemaMismatch for
    sound files of another schema version.
    """
    size, header = _parse_header(buf)
    metadata = header["__metadata__"]
    checksum, meta_text = metadata.get(CHECKSUM_KEY), metadata.get(META_KEY)
    if not isinstance(checksum, str) or len(checksum) != 64 or not isinstance(meta_text, str):
        raise CorruptSnapshot("header metadata lacks the b12x checksum or snapshot record")
    _tensor_table(header, len(buf) - 8 - size)  # sizes first: a truncated file is a load error
    raw = bytes(buf[8 : 8 + size])
    if raw.count(_field(checksum)) != 1:
        raise ChecksumMismatch("checksum field is not where the writer puts it")
    if digests is None:
        digests = chunk_digests(memoryview(buf)[8 + size :], pool)
    digest = hashlib.sha256(bytes(buf[:8]) + raw.replace(_field(checksum), _field(_ZEROS)) + digests).hexdigest()
    if digest != checksum:
        raise ChecksumMismatch(f"sha256 {digest[:16]}… does not match the recorded {checksum[:16]}…")
    try:
        meta = strict_json.loads(meta_text)
    except strict_json.StrictJsonError as exc:
        raise CorruptSnapshot(f"snapshot record {META_KEY!r} is not strict JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("schema") != SNAPSHOT_SCHEMA:
        raise SchemaMismatch(f"snapshot schema {meta.get('schema') if isinstance(meta, dict) else None!r}; "
                             f"this runtime reads schema {SNAPSHOT_SCHEMA}")
    return meta


def decode(buf, identity: Identity, digests: bytes | None = None, pool=None) -> Snapshot:
    """Verify and decode a whole file's bytes (a writable buffer) into a Snapshot whose tensors view `buf`."""
    meta = verify(buf, digests, pool)
    size, header = _parse_header(buf)
    table = _tensor_table(header, len(buf) - 8 - size)
    try:
        stored = meta["identity"]
        length, caches_meta, kind, hashed = int(meta["length"]), meta["caches"], meta["kind"], meta["token_hash"]
    except (KeyError, TypeError, ValueError):
        raise CorruptSnapshot("snapshot record lacks identity, length, caches, kind or token_hash") from None
    if not isinstance(stored, dict) or stored.get("key") != identity.key or stored.get("fields") != identity.fields:
        raise IdentityMismatch("snapshot was made for another package")
    if not isinstance(caches_meta, dict) or set(table) - {"logits", "tokens"} != set(caches_meta):
        raise CorruptSnapshot("tensors and per-cache records differ")

    def tensor(name):
        start, dtype, shape, count = table[name]
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=8 + size + start).view(shape)

    if "tokens" not in table or table["tokens"][1:3] != (torch.int32, [length]):
        raise CorruptSnapshot(f"tokens tensor does not hold {length} ids")
    tokens = bytes(memoryview(buf)[8 + size + table["tokens"][0] :][: TOKEN_BYTES * length])
    if token_hash(identity.key, tokens) != hashed:
        raise CorruptSnapshot("token ids do not match the recorded token hash")
    if "logits" in table and (table["logits"][1] != torch.float32 or len(table["logits"][2]) != 1):
        raise CorruptSnapshot("logits tensor is not float32 [vocab]")
    logits = tensor("logits") if "logits" in table else None
    caches = {name: tensor(name) for name in caches_meta}
    return Snapshot(Identity(stored["fields"], stored["key"]), length, tokens, hashed, caches, caches_meta, logits, kind)
