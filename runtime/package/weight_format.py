"""A weight tensor's storage format: what its bytes are and how its scales tile it.

    fp32, bf16                    plain tensors, no scale
    fp8_e4m3  block [bm, bn]      E4M3 data [.., out, in] + a scale per bm x bn block
    fp4_e2m1  block [1, 32]       E2M1 packed two per int8 byte [.., out, in / 2], the low
                                  nibble the even column, + a UE8M0 scale per 32 inputs

A block tiles the last two axes (out, in); leading axes (routed experts) are kept. The
scale grid is a ceiling grid, [ceil(out / bm), ceil(in / bn)], as DeepSeek's checkpoints
pad a partial block (576 x 7168 in 128 x 128 blocks has a 5 x 56 grid). The decoded
weight is data x scale of its block. Scale encodings: `ue8m0` is stored as
float8_e8m0fnu, one byte 2^(byte - 127) (the release's own F8_E8M0; a uint8 or float32
power-of-two scale is converted to it on import), `fp32` as float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KINDS = ("fp32", "bf16", "fp8_e4m3", "fp4_e2m1")
SCALE_ENCODINGS = ("ue8m0", "fp32")
FP8_BLOCKS = ((128, 128), (32, 32), (1, 32))
FP4_BLOCK = (1, 32)
DATA_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp4_e2m1": "int8"}
SCALE_DTYPES = {"ue8m0": "float8_e8m0fnu", "fp32": "float32"}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1, "float8_e8m0fnu": 1}


def _blocks(blocks) -> str:
    return ", ".join(f"{m}x{n}" for m, n in blocks)


def format_problem(kind, block, scale_encoding) -> tuple[str, str] | None:
    """(field at fault, what is wrong) of this combination, or None: one rule for the recipe and
    the manifest. The field is `kind`, `block` or `scale_encoding`."""
    if kind not in KINDS:
        return "kind", f"{kind!r} is not one of {', '.join(KINDS)}"
    if kind in ("fp32", "bf16"):
        if block is not None:
            return "block", f"{kind} has no block (got {_show(block)}); only fp8_e4m3 and fp4_e2m1 are block-scaled"
        if scale_encoding is not None:
            return "scale_encoding", (f"{kind} carries no scale (got {scale_encoding!r}); only fp8_e4m3 and "
                                      "fp4_e2m1 do")
        return None
    if block is None:
        return "block", f"{kind} needs a block ({_blocks(FP8_BLOCKS if kind == 'fp8_e4m3' else [FP4_BLOCK])})"
    if scale_encoding is None:
        return "scale_encoding", f"{kind} needs a scale encoding ({'ue8m0, fp32' if kind == 'fp8_e4m3' else 'ue8m0'})"
    if kind == "fp8_e4m3":
        if block not in FP8_BLOCKS:
            return "block", f"{_show(block)} is not a block fp8_e4m3 takes ({_blocks(FP8_BLOCKS)})"
        if scale_encoding not in SCALE_ENCODINGS:
            return "scale_encoding", (f"{scale_encoding!r} is not a scale encoding fp8_e4m3 takes "
                                      f"({', '.join(SCALE_ENCODINGS)})")
        return None
    if block != FP4_BLOCK:
        return "block", f"{_show(block)} is not the block fp4_e2m1 takes ({_blocks([FP4_BLOCK])})"
    if scale_encoding != "ue8m0":
        return "scale_encoding", f"{scale_encoding!r} is not the scale encoding fp4_e2m1 takes (ue8m0)"
    return None


def _show(block) -> str:
    if isinstance(block, (tuple, list)) and len(block) == 2 and all(isinstance(b, int) for b in block):
        return f"{block[0]}x{block[1]}"
    return repr(block)


@dataclass(frozen=True)
class WeightFormat:
    kind: str
    block: tuple[int, int] | None = None
    scale_encoding: str | None = None

    def __post_init__(self):
        problem = format_problem(self.kind, self.block, self.scale_encoding)
        if problem:
            raise ValueError(f"{problem[0]}: {problem[1]}")

    @property
    def quantized(self) -> bool:
        return self.block is not None

    @property
    def data_dtype(self) -> str:
        return DATA_DTYPES[self.kind]

    @property
    def scale_dtype(self) -> str | None:
        return None if self.scale_encoding is None else SCALE_DTYPES[self.scale_encoding]

    def shape_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why a logical tensor of `shape` cannot be stored in this format, or None."""
        if not self.quantized:
            return None
        if len(shape) < 2:
            return f"shape {list(shape)} has no [out, in] axes to tile with blocks"
        if self.kind == "fp4_e2m1" and shape[-1] % FP4_BLOCK[1]:
            return (f"input dimension {shape[-1]} is not a multiple of 32; fp4_e2m1 packs two values a byte"
                    " and scales whole groups of 32")
        return None

    def data_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored data tensor of a logical tensor of `shape` (fp4: two values a byte)."""
        return shape[:-1] + (shape[-1] // 2,) if self.kind == "fp4_e2m1" else tuple(shape)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The stored scale tensor: a ceiling grid of blocks over the last two axes (None: no scale)."""
        if not self.quantized:
            return None
        bm, bn = self.block
        return tuple(shape[:-2]) + (math.ceil(shape[-2] / bm), math.ceil(shape[-1] / bn))

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Stored bytes of a logical tensor of `shape`: data plus scales."""
        total = math.prod(self.data_shape(shape)) * ITEMSIZE[self.data_dtype]
        scale = self.scale_shape(shape)
        return total + (0 if scale is None else math.prod(scale) * ITEMSIZE[self.scale_dtype])

    def describe(self) -> str:
        """`fp32`, `bf16`, `fp8_e4m3 32x32 ue8m0`, `fp4_e2m1 1x32 ue8m0`."""
        if not self.quantized:
            return self.kind
        return f"{self.kind} {self.block[0]}x{self.block[1]} {self.scale_encoding}"

    def to_json(self) -> dict:
        out = {"kind": self.kind}
        if self.quantized:
            out.update(block=list(self.block), scale_encoding=self.scale_encoding)
        return out

    @classmethod
    def from_json(cls, data, field: str) -> "WeightFormat":
        """Strict: exactly {kind} or {kind, block, scale_encoding}; ValueError names `field`."""
        if not isinstance(data, dict) or "kind" not in data or not set(data) <= {"kind", "block", "scale_encoding"}:
            raise ValueError(f"{field}: {data!r:.200} is not {{kind}} or {{kind, block, scale_encoding}}")
        block = data.get("block")
        if isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block):
            block = tuple(block)
        elif "block" in data:
            raise ValueError(f"{field}.block: {block!r:.200} is not [rows, columns] of positive sizes")
        problem = format_problem(data["kind"], block, data.get("scale_encoding"))
        if problem:
            raise ValueError(f"{field}.{problem[0]}: {problem[1]}")
        return cls(data["kind"], block, data.get("scale_encoding"))


FP32 = WeightFormat("fp32")
