"""The calling convention of a pass: named buffers with role, dtype and symbolic shape.

Symbols: "slots" is the session's slot count (+1 scratch slot), "rows" the rows bucket,
and each page pool (kinds.POOLS) its page count: the pages a paged cache holds.
A spec may carry its `info` (contract.py: what the buffer is — kind, layer, format...),
which the manifest records apart from the calling convention (the `buffers` table and
each pass's `row_inputs`), so the convention's JSON keeps exactly its four keys.

The ABI fingerprint hashes the calling conventions of all passes together with that
data, each pass's width, advancing input and staging source, and the weights' storage
formats: everything a server binds and drives a pass by. It moves exactly when those move, never with the rewrite
pipeline.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from b12x_toolchain.runtime.package.contract import BufferInfo
from b12x_toolchain.runtime.package.kinds import POOLS

ROLES = ("weight", "cache", "staging", "input", "output")
SYMBOLS = ("slots", "rows") + POOLS
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
    # Weights in their storage formats (runtime/formats/weight_formats.py): E4M3 data, packed
    # E2M1, UE8M0 scales.
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class BufferSpec:
    name: str
    role: str
    dtype: str
    shape: tuple  # ints and symbols
    info: BufferInfo | None = None  # what it is; None for weights and outputs

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"buffer {self.name}: role {self.role!r} is not one of {ROLES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"buffer {self.name}: dtype {self.dtype!r} is not one of {tuple(DTYPES)}")
        for dim in self.shape:
            if not (isinstance(dim, int) and dim >= 0) and dim not in SYMBOLS:
                raise ValueError(f"buffer {self.name}: shape entry {dim!r} is neither a size nor one of {SYMBOLS}")
        if self.info is not None:
            self.info.check(self)

    def resolve(self, symbols: dict) -> tuple[int, ...]:
        return tuple(symbols[d] if isinstance(d, str) else d for d in self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_json(self) -> dict:
        """The calling-convention entry: the info is recorded apart (see above)."""
        return {"name": self.name, "role": self.role, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: dict, info: BufferInfo | None = None) -> "BufferSpec":
        if not isinstance(data, dict) or set(data) != {"name", "role", "dtype", "shape"}:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"buffer entry has keys {keys}; expected name, role, dtype, shape")
        if not isinstance(data["shape"], list):
            raise ValueError(f"buffer {data['name']}: shape {data['shape']!r} is not a list")
        return cls(data["name"], data["role"], data["dtype"], tuple(data["shape"]), info)


# What of a pass entry the fingerprint covers: not its graph file or rows buckets.
PASS_CONTRACT = ("inputs", "outputs", "width", "advances", "reads_staging_of", "row_inputs")


def contract(passes: dict, buffers, cache_formats=None, weight_formats=None) -> dict:
    """The fingerprinted part of a manifest, from its `passes`, `buffers` and `cache_formats`
    entries: whose bytes the caches hold binds an engine as much as their shapes do. So do the
    weights' storage formats (`weights.formats`), taken in only when some weight is not fp32,
    so an all-fp32 package keeps the fingerprint it had before formats existed."""
    out = {"buffers": buffers, "cache_formats": cache_formats,
           "passes": {n: {k: e.get(k) for k in PASS_CONTRACT} if isinstance(e, dict) else e for n, e in passes.items()}}
    if weight_formats:
        out["weight_formats"] = weight_formats
    return out


def fingerprint(contract: dict) -> str:
    """sha256 over `contract(...)`, in a canonical JSON form."""
    canonical = json.dumps(contract, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
