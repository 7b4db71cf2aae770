"""Read weights from a checkpoint directory in the Hugging Face safetensors layout.

A checkpoint directory holds `model.safetensors.index.json` (`weight_map`: tensor name →
shard file) and the shards, or a single `model.safetensors`. Only the tensors a package
asks for are read; every one is checked by name against what the package expects
(dtype, shape and, when the package records one, the sha256 of its bytes) before the
session sees it, so a wrong checkpoint fails at load, naming the tensor, never at replay.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import safe_open

from b12x_toolchain.runtime.errors import CheckpointError
from b12x_toolchain.runtime.strict_json import load_document

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
INDEX_LIMIT = 64 << 20
# safetensors dtype codes for the dtypes a calling convention may use (runtime/package/abi.py),
# weights in their storage formats included: E4M3 data, UE8M0 scales, packed E2M1 as int8.
DTYPE_CODES = {"F32": "float32", "BF16": "bfloat16", "I32": "int32", "I64": "int64", "U8": "uint8", "BOOL": "bool",
               "F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu", "I8": "int8"}


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order: what a safetensors shard stores for it."""
    data = tensor.detach().contiguous().cpu()
    return hashlib.sha256(data.view(torch.uint8).reshape(-1).numpy().tobytes()).hexdigest()


def _shard(root: Path, name: object, tensor: str) -> Path:
    # The index comes from outside the package: a shard must be a plain file name inside the directory.
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise CheckpointError(f"{INDEX}: shard {name!r} of tensor {tensor} is not a file name in the checkpoint")
    return root / name


def weight_map(root) -> dict[str, Path]:
    """Tensor name → shard path, from the index or from a single-file checkpoint."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    index = root / INDEX
    if index.is_file():
        if index.stat().st_size > INDEX_LIMIT:
            raise CheckpointError(f"{INDEX}: larger than {INDEX_LIMIT} bytes")
        document = load_document(index.read_bytes(), INDEX, CheckpointError)  # strict: no duplicate keys
        mapping = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(mapping, dict):
            raise CheckpointError(f"{INDEX}: 'weight_map' is missing or not an object")
        return {name: _shard(root, shard, name) for name, shard in mapping.items()}
    single = root / SINGLE
    if single.is_file():
        try:
            handle = safe_open(str(single), framework="pt")
        except Exception as exc:  # safetensors raises its own error type for malformed headers
            raise CheckpointError(f"{SINGLE}: not a valid safetensors file ({exc})") from None
        with handle:
            return {name: single for name in handle.keys()}
    raise CheckpointError(f"{root}: holds neither {INDEX} nor {SINGLE}")


def read_checkpoint(root, expected: dict[str, tuple[str, tuple[int, ...]]],
                    checksums: dict[str, str] | None = None, *, whose: str = "package's") -> dict[str, torch.Tensor]:
    """Load the `expected` tensors (name → (dtype, shape)); extra checkpoint tensors are ignored.

    `whose` names the side that expects them in error messages: the runtime binds a
    package's weights, the exporter imports a recipe's.
    """
    mapping = weight_map(root)
    missing = sorted(set(expected) - set(mapping))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{missing[0]}: not in the checkpoint{more}")
    by_shard: dict[Path, list[str]] = {}
    for name in sorted(expected):
        by_shard.setdefault(mapping[name], []).append(name)
    tensors = {}
    for shard, names in sorted(by_shard.items()):
        if not shard.is_file():
            raise CheckpointError(f"{names[0]}: its shard {shard.name} is missing from the checkpoint")
        try:
            handle = safe_open(str(shard), framework="pt")
        except Exception as exc:  # safetensors raises its own error type for malformed headers
            raise CheckpointError(f"{shard.name}: not a valid safetensors file ({exc})") from None
        with handle:
            stored = set(handle.keys())
            for name in names:
                if name not in stored:
                    raise CheckpointError(f"{name}: the index maps it to {shard.name}, which does not hold it")
                tensors[name] = _checked(name, handle, shard.name, *expected[name], (checksums or {}).get(name), whose)
    return tensors


def _checked(name: str, handle, shard: str, dtype: str, shape: tuple, checksum: str | None,
             whose: str) -> torch.Tensor:
    # Dtype and shape come from the shard header: a misshapen tensor is refused before it is read.
    piece = handle.get_slice(name)
    got_dtype, got_shape = DTYPE_CODES.get(piece.get_dtype(), piece.get_dtype()), tuple(piece.get_shape())
    if got_dtype != dtype:
        raise CheckpointError(f"{name}: dtype {got_dtype} in {shard} does not match the {whose} {dtype}")
    if got_shape != tuple(shape):
        raise CheckpointError(f"{name}: shape {list(got_shape)} in {shard} does not match the {whose} {list(shape)}")
    tensor = handle.get_tensor(name)
    if checksum is not None:
        actual = tensor_sha256(tensor)
        if actual != checksum:
            raise CheckpointError(f"{name}: sha256 {actual[:16]}… in {shard} does not match the {whose} {checksum[:16]}…")
    return tensor
