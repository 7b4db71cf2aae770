"""Which weights a package needs, and where they come from: its own file or a checkpoint.

What a pass binds is fixed by its calling convention (the weight inputs, covered by the
ABI fingerprint), so that is what every source is checked against. A full package
stores the weights in `weights.safetensors`. A structural package stores none: its
manifest marks them external and lists them (name, dtype, shape, and the sha256 of each
tensor when the exporter was given a checkpoint index), and `load(path, weights=DIR)`
binds them from a checkpoint directory. The list must equal the weight inputs: a manifest
that asked for other tensors than the graphs take would bind the wrong thing.
"""

from __future__ import annotations

import math
import sys
import warnings

import torch

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.package.checkpoint import read_checkpoint
from b12x_toolchain.runtime.strict_json import safetensors_header


def weight_inputs(passes: dict) -> dict[str, tuple[str, tuple]]:
    """name → (dtype, shape) of every weight input of every pass; passes must agree."""
    specs = {}
    for info in passes.values():
        for spec in info.inputs:
            if spec.role == "weight":
                entry = (spec.dtype, tuple(spec.shape))
                if specs.setdefault(spec.name, entry) != entry:
                    raise PackageError(f"manifest.json: passes disagree on weight {spec.name}")
    return specs


def _external_list(weights, expected: dict) -> dict[str, str]:
    """Check weights.tensors against the weight inputs; returns the recorded checksums."""
    tensors = weights.tensors
    for name in sorted(set(tensors) | set(expected)):
        listed = tensors.get(name)
        if name not in expected:
            raise PackageError(f"manifest.json: weights.tensors lists {name}, which no pass takes")
        if listed is None:
            raise PackageError(f"manifest.json: weights.tensors does not list {name}, which the passes take")
        if (listed.dtype, listed.shape) != expected[name]:
            raise PackageError(f"manifest.json: weights.tensors.{name} does not match the pass inputs "
                               f"({expected[name][0]} {list(expected[name][1])})")
    return {name: t.sha256 for name, t in tensors.items() if t.sha256}


def _check_embedded(name: str, weights: dict[str, torch.Tensor], expected: dict) -> None:
    for weight, (dtype, shape) in sorted(expected.items()):
        tensor = weights.get(weight)
        if tensor is None:
            raise PackageError(f"{name}: does not hold weight {weight}")
        if str(tensor.dtype).removeprefix("torch.") != dtype or tuple(tensor.shape) != shape:
            raise PackageError(f"{name}: weight {weight} is {tensor.dtype} {list(tensor.shape)}; "
                               f"the passes take {dtype} {list(shape)}")


def bind_weights(manifest, contents: dict[str, bytes | bytearray], passes: dict, checkpoint=None, mapping=None,
                 rank: int | None = None):
    """The weights a session binds, or None for a structural package loaded without a checkpoint.

    `manifest`: the typed Manifest (manifest.py). A parallel package (`mapping`,
    runtime/parallel/mapping.py) binds rank `rank`'s shards: stored per rank, or cut out of a
    whole checkpoint by the mapping's splits."""
    entry = manifest.weights
    expected = weight_inputs(passes)
    whole = expected if mapping is None else _whole(expected, mapping)
    if entry.external:
        checksums = _external_list(entry, whole)
        return None if checkpoint is None else _shards(read_checkpoint(checkpoint, whole, checksums), mapping, rank)
    if checkpoint is not None:  # a checkpoint replaces the stored weights (same names and shapes)
        return _shards(read_checkpoint(checkpoint, whole), mapping, rank)
    name = entry.file if mapping is None else mapping.ranks[rank].weights
    if name not in contents:
        raise PackageError(f"manifest.json: weights file {name!r} is not a listed file")
    safetensors_header(contents[name], name)  # strict JSON first: no duplicated tensor names
    weights = load_weights_bytes(contents[name], name)
    _check_embedded(name, weights, expected)
    return weights


# The dtypes a package's weights are stored in, by safetensors' names. safetensors.torch.load
# (0.8.0) has no torch dtype for F8_E8M0, the UE8M0 scales' own, and raises KeyError on
# it; its file readers do, but a package's weights are read from the bytes whose sha256
# was checked, so they are viewed here directly.
STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                 "I8": torch.int8, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu}


class _Malformed(ValueError):
    pass


def load_weights_bytes(data: bytes | bytearray, name: str) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file `name`'s bytes, each a CPU tensor of its stored dtype
    that views `data` in place: one storage, `data`'s own memory. Loading a package therefore
    holds its weight file's bytes once, and what is bound is exactly what was hashed
    (safetensors.deserialize, used before, copied every tensor out: twice the bytes at load)."""
    if sys.byteorder != "little":
        raise PackageError(f"{name}: safetensors data is little-endian; this machine is {sys.byteorder}-endian")
    start, entries = _layout(data, name)
    with warnings.catch_warnings():
        # Immutable bytes (a caller's file.read_bytes()) make torch warn that the tensors alias
        # them; weights are graph inputs, never written. The loader passes a bytearray.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        whole = torch.frombuffer(data, dtype=torch.uint8)
    out = {}
    for key, (dtype, shape, begin, end) in entries.items():
        raw = whole[start + begin : start + end]
        if (start + begin) % dtype.itemsize:  # safetensors aligns every tensor; a file that does not is copied
            raw = raw.clone()
        out[key] = raw.view(dtype).reshape(shape)
    return out


def _layout(data: bytes | bytearray, name: str) -> tuple[int, dict]:
    """(offset of the tensor data, name -> (dtype, shape, begin, end) within it), the header
    checked as safetensors' own reader checks it: every entry's byte count is its shape's, and
    the entries tile the data exactly (no gap, overlap or trailing byte)."""
    try:
        header = safetensors_header(data, "header", _Malformed)  # strict JSON
        start = 8 + int.from_bytes(data[:8], "little")
        entries = {key: _entry(key, info, name) for key, info in header.items() if key != "__metadata__"}
        covered = 0
        for key, (_, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
            if begin != covered:
                raise _Malformed(f"tensor {key} starts at data byte {begin}, not {covered}")
            covered = end
        if covered != len(data) - start:
            raise _Malformed(f"the tensors cover {covered} of the {len(data) - start} data bytes")
    except _Malformed as exc:
        raise PackageError(f"{name}: not a valid safetensors file ({exc})") from None
    return start, entries


def _entry(key: str, info, name: str) -> tuple:
    if not (isinstance(info, dict) and set(info) == {"dtype", "shape", "data_offsets"}):
        raise _Malformed(f"tensor {key}: expected exactly dtype, shape and data_offsets")
    dtype = STORED_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise PackageError(f"{name}: tensor {key} is {info['dtype']}, not a dtype a package stores "
                           f"({', '.join(STORED_DTYPES)})")
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(_natural(d) for d in shape)):
        raise _Malformed(f"tensor {key}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_natural, offsets))
            and offsets[0] <= offsets[1]):
        raise _Malformed(f"tensor {key}: data_offsets {offsets!r} is not [begin, end]")
    if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
        raise _Malformed(f"tensor {key}: {offsets[1] - offsets[0]} bytes for {info['dtype']} {shape}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def _natural(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


ENGRAM_TABLE_PLACES = ("device", "host")


def check_engram_tables_place(engram_tables) -> None:
    if not isinstance(engram_tables, str) or engram_tables not in ENGRAM_TABLE_PLACES:
        raise ValueError(f"engram_tables={engram_tables!r}: expected one of {', '.join(map(repr, ENGRAM_TABLE_PLACES))}")


def place_weights(weights: dict[str, torch.Tensor], device: torch.device, tables, engram_tables: str = "device"):
    """Every weight on `device`; with engram_tables="host" on a CUDA device, the Engram tables
    (`tables`: the manifest's weights.engram_tables, data and scales) stay in host memory, pinned,
    and the lookup reads the rows it needs in place (a CUDA graph's replay included). On a CPU
    device both places are the same."""
    check_engram_tables_place(engram_tables)
    host = set(tables) if engram_tables == "host" and device.type == "cuda" else set()
    return {name: t.pin_memory() if name in host else t.to(device) for name, t in weights.items()}


def _whole(expected: dict, mapping) -> dict:
    """The whole tensors a rank's weight inputs are cut from."""
    for name in mapping.splits:
        if name not in expected:
            raise PackageError(f"manifest.json: parallel.splits names {name}, which no pass takes")
    out = {}
    for name, (dtype, shape) in expected.items():
        split = mapping.splits.get(name)
        if split is not None and split.axis >= len(shape):
            raise PackageError(f"manifest.json: parallel.splits.{name} cuts axis {split.axis} of a "
                               f"{len(shape)}-axis tensor")
        whole = split.whole(shape) if split else shape
        if split is not None and split.shape(whole) != shape:
            raise PackageError(f"manifest.json: parallel.splits.{name} gives a rank {list(split.shape(whole))} of a "
                               f"{list(whole)} tensor; the passes take {list(shape)}")
        out[name] = (dtype, whole)
    return out


def _shards(weights: dict, mapping, rank):
    if mapping is None:
        return weights
    return {name: mapping.splits[name].take(t, rank) if name in mapping.splits else t for name, t in weights.items()}
