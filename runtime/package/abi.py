"""The calling convention of a pass: named buffers with role, dtype and symbolic shape.

Symbols: "slots" is the session's slot count (+1 scratch slot), "rows" the rows bucket.
The ABI fingerprint hashes the calling conventions of all passes, so it moves exactly
when what a server binds moves, and never with the rewrite pipeline.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

ROLES = ("weight", "cache", "staging", "input", "output")
SYMBOLS = ("slots", "rows")
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class BufferSpec:
    name: str
    role: str
    dtype: str
    shape: tuple  # ints and symbols

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"buffer {self.name}: role {self.role!r} is not one of {ROLES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"buffer {self.name}: dtype {self.dtype!r} is not one of {tuple(DTYPES)}")
        for dim in self.shape:
            if not (isinstance(dim, int) and dim >= 0) and dim not in SYMBOLS:
                raise ValueError(f"buffer {self.name}: shape entry {dim!r} is neither a size nor one of {SYMBOLS}")

    def resolve(self, symbols: dict) -> tuple[int, ...]:
        return tuple(symbols[d] if isinstance(d, str) else d for d in self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_json(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: dict) -> "BufferSpec":
        if set(data) != {"name", "role", "dtype", "shape"}:
            raise ValueError(f"buffer entry has keys {sorted(data)}; expected name, role, dtype, shape")
        return cls(data["name"], data["role"], data["dtype"], tuple(data["shape"]))


def fingerprint(conventions: dict[str, dict]) -> str:
    """sha256 over every pass's inputs and outputs, in a canonical JSON form."""
    canonical = json.dumps(conventions, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
