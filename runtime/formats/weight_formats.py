"""A weight tensor's storage format (`WeightFormat`), its exact decoding, and the quantizers
that make it, as DeepSeek's checkpoints store it.

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

Canonical storage (what a package stores and the quantized ops take):

* FP8 block-scaled: weight ``torch.float8_e4m3fn`` ``[out, in]``; one scale per block of
  ``(bm, bn)`` weights, ``(bm, bn)`` one of ``FP8_BLOCKS`` ((128, 128) in V3/V4, (32, 32) in
  V4.1, (1, 32) for row-wise tables), scale shape ``[ceil(out / bm), ceil(in / bn)]``,
  either UE8M0 as ``torch.float8_e8m0fnu`` (value ``2^(byte - 127)``) or ``float32``.
  Partial edge blocks are as if padded with zeros. Value = ``e4m3 * scale``.
* FP4 E2M1 (routed experts): ``torch.int8`` ``[..., in / 2]``, two codes a byte, the LOW
  nibble holding the EVEN column; bit 3 of a code is the sign, bits 0-2 index the
  magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; scale UE8M0 ``torch.float8_e8m0fnu``
  ``[..., in / 32]``, one per 32 consecutive inputs. Value = ``e2m1 * scale``.

UE8M0 scales arrive as F8_E8M0, as ``uint8`` biased exponents or as float32 powers of two;
`ue8m0_from` turns each into the one canonical ``float8_e8m0fnu`` tensor.

Decoding is exact: a product of two float32 values is exact in float64, so the float32
multiply here rounds once, exactly as ``float32(float64(value) * float64(scale))``. With
UE8M0 scales no rounding happens at all (the products are representable).

The quantizers follow DeepSeek's rounding: the UE8M0 exponent is ``ceil(log2(q))`` taken
exactly on the float32 bits of ``q = max(amax, floor) / qmax`` (the quotient is rounded to
float32 first, as DeepSeek's kernels divide in float32), and elements round to nearest
even. `act_quant_e4m3` is DeepSeek's activation rule for FP8/FP4 linears.
"""


from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from b12x_toolchain.runtime.formats.minifloat import (
    _E2M1_MAX,
    _E4M3_MAX,
    _blocks,
    _e4m3_bytes_to_f32,
    _mx_decode,
    _pack_e2m1,
    _pow2_table,
    _to_e4m3_bytes,
    _unpack_e2m1,
)

ELEMENT_TYPES = ("fp32", "bf16", "fp8_e4m3", "fp4_e2m1")  # what a stored weight's elements are
SCALE_ENCODINGS = ("ue8m0", "fp32")
FP8_BLOCKS = ((128, 128), (32, 32), (1, 32))
"""The FP8 scale blocks (rows, columns) DeepSeek checkpoints use."""
FP4_GROUP = 32  # inputs per FP4 scale
FP4_BLOCK = (1, FP4_GROUP)
DATA_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp4_e2m1": "int8"}
SCALE_DTYPES = {"ue8m0": "float8_e8m0fnu", "fp32": "float32"}
ACT_GROUP = 128  # channels per DeepSeek activation scale
ACT_MIN_AMAX = 1e-4  # DeepSeek's act_quant floor; applied as the float32 nearest 1e-4
# Keeps amax / 6 a normal float32, whose exponent the bits give; an all-zero FP4 block
# gets the scale 2^-126.
_FP4_MIN_AMAX = _E2M1_MAX * 2.0**-126


# ---------------------------------------------------------------- the format of a stored weight


def _show_blocks(blocks) -> str:
    return ", ".join(f"{m}x{n}" for m, n in blocks)


def format_problem(kind, block, scale_encoding) -> tuple[str, str] | None:
    """(field at fault, what is wrong) of this combination, or None: one rule for the recipe and
    the manifest. The field is `kind`, `block` or `scale_encoding`."""
    if kind not in ELEMENT_TYPES:
        return "kind", f"{kind!r} is not one of {', '.join(ELEMENT_TYPES)}"
    if kind in ("fp32", "bf16"):
        if block is not None:
            return "block", f"{kind} has no block (got {_show(block)}); only fp8_e4m3 and fp4_e2m1 are block-scaled"
        if scale_encoding is not None:
            return "scale_encoding", (f"{kind} carries no scale (got {scale_encoding!r}); only fp8_e4m3 and "
                                      "fp4_e2m1 do")
        return None
    if block is None:
        return "block", f"{kind} needs a block ({_show_blocks(FP8_BLOCKS if kind == 'fp8_e4m3' else [FP4_BLOCK])})"
    if scale_encoding is None:
        return "scale_encoding", f"{kind} needs a scale encoding ({'ue8m0, fp32' if kind == 'fp8_e4m3' else 'ue8m0'})"
    if kind == "fp8_e4m3":
        if block not in FP8_BLOCKS:
            return "block", f"{_show(block)} is not a block fp8_e4m3 takes ({_show_blocks(FP8_BLOCKS)})"
        if scale_encoding not in SCALE_ENCODINGS:
            return "scale_encoding", (f"{scale_encoding!r} is not a scale encoding fp8_e4m3 takes "
                                      f"({', '.join(SCALE_ENCODINGS)})")
        return None
    if block != FP4_BLOCK:
        return "block", f"{_show(block)} is not the block fp4_e2m1 takes ({_show_blocks([FP4_BLOCK])})"
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
        if self.kind == "fp4_e2m1" and shape[-1] % FP4_GROUP:
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
        total = math.prod(self.data_shape(shape)) * getattr(torch, self.data_dtype).itemsize
        scale = self.scale_shape(shape)
        return total + (0 if scale is None else math.prod(scale) * getattr(torch, self.scale_dtype).itemsize)

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
BF16 = WeightFormat("bf16")
FP4_E2M1 = WeightFormat("fp4_e2m1", FP4_BLOCK, "ue8m0")


def _is_pow2_float32(bits: torch.Tensor) -> torch.Tensor:
    """Where float32 bits hold 2^-127 .. 2^127: a normal with a zero mantissa, or 2^-127."""
    exponent = (bits >> 23) & 0xFF
    normal = (bits & 0x807FFFFF) == 0
    return (normal & (exponent > 0) & (exponent < 255)) | (bits == 0x00400000)


def ue8m0_from(scale: torch.Tensor) -> torch.Tensor:
    """The canonical ``float8_e8m0fnu`` tensor of UE8M0 scales given as F8_E8M0, uint8 or float32.

    A uint8 byte is the biased exponent (value ``2^(byte - 127)``). A float32 scale must
    be an exact power of two in 2^-127 .. 2^127; anything else is refused, naming it.
    """
    if scale.dtype == torch.float8_e8m0fnu:
        return scale
    if scale.dtype == torch.uint8:
        return scale.view(torch.float8_e8m0fnu)
    if scale.dtype != torch.float32:
        raise ValueError(f"UE8M0 scales must be float8_e8m0fnu, uint8 or float32 powers of two, not {scale.dtype}")
    bits = scale.contiguous().view(torch.int32)
    bad = ~_is_pow2_float32(bits)
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"float32 scale {scale[at].item()!r} at index {at} is not a power of two "
                         "in 2^-127 .. 2^127, so it has no UE8M0 encoding")
    # A power of two's biased float32 exponent is its UE8M0 byte; 2^-127 (a subnormal,
    # exponent field 0) is byte 0 too.
    return ((bits >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_ceil_exponent(q: torch.Tensor) -> torch.Tensor:
    """int32 ceil(log2 q) of positive normal float32 q, exact (on the bits)."""
    bits = q.view(torch.int32)
    return (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """float32 2^exponent for int exponents in -127 .. 127."""
    return _pow2_table(exponent.device)[(exponent + 127).long()]


def _ue8m0_bytes(exponent: torch.Tensor) -> torch.Tensor:
    return (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _refuse_non_finite(w: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{what} holds non-finite values; only finite weights can be quantized")


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """float32 values of canonical block scales (UE8M0 through the exact table, or float32)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return _pow2_table(scale.device)[scale.view(torch.uint8).long()]
    return scale


# ---------------------------------------------------------------- FP8 block-scaled


def scale_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(out / bm), ceil(in / bn)]: the scale shape of an FP8 weight [out, in]."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def check_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    """Refuse, naming it, anything that is not a canonical FP8 block-scaled weight."""
    block = tuple(block)
    if block not in FP8_BLOCKS:
        raise ValueError(f"FP8 block {block} is not one of {FP8_BLOCKS}")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"an FP8 weight is a 2-d float8_e4m3fn tensor [out, in], not {weight.dtype} "
                         f"{list(weight.shape)}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.float32):
        raise ValueError(f"an FP8 block scale is float8_e8m0fnu or float32, not {scale.dtype} "
                         "(ue8m0_from gives the canonical UE8M0 tensor)")
    want = scale_grid(tuple(weight.shape), block)
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 weight {list(weight.shape)} with {block} blocks needs a scale of shape "
                         f"{list(want)}, not {list(scale.shape)}")


def decode_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 [out, in] values of an FP8 block-scaled weight, exact.

    Extra memory beyond the result: one row of scales per input column ([ceil(out/bm), in]).
    """
    check_fp8_block(weight, scale, block)
    bm, bn = block
    n_out, n_in = weight.shape
    out = weight.to(torch.float32)
    per_column = _scale_values(scale).repeat_interleave(bn, dim=1)[:, :n_in]  # [ceil(out/bm), in]
    whole = n_out // bm
    # In place, a block row at a time through a view: no [out, in] scale tensor.
    out[: whole * bm].view(whole, bm, n_in).mul_(per_column[:whole, None, :])
    if whole * bm < n_out:
        out[whole * bm :].mul_(per_column[whole])
    return out


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int], scale_encoding: str = "ue8m0"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, scale) of float weights w [out, in] in (bm, bn) blocks.

    ``ue8m0``: scale ``2^ceil(log2(max(amax, 1e-4) / 448))``, so ``w / scale`` is exact and
    never exceeds 448. ``fp32``: scale ``max(amax, 1e-4) / 448`` (the floor keeps an
    all-zero block's scale nonzero). Elements ``E4M3(clamp(w / scale, ±448))``, nearest
    even. Partial edge blocks take their amax over the weights they hold.
    """
    block = tuple(block)
    if block not in FP8_BLOCKS:
        raise ValueError(f"FP8 block {block} is not one of {FP8_BLOCKS}")
    if scale_encoding not in SCALE_ENCODINGS:
        raise ValueError(f"FP8 scale encoding {scale_encoding!r} is not one of {SCALE_ENCODINGS}")
    if w.dim() != 2:
        raise ValueError(f"an FP8 weight is 2-d [out, in], not {list(w.shape)}")
    _refuse_non_finite(w, "the FP8 weight")
    bm, bn = block
    n_out, n_in = w.shape
    gm, gn = scale_grid((n_out, n_in), block)
    padded = F.pad(w.to(torch.float32), (0, gn * bn - n_in, 0, gm * bm - n_out)).view(gm, bm, gn, bn)
    q = padded.abs().amax(dim=(1, 3)).clamp_min(ACT_MIN_AMAX) / _E4M3_MAX
    if scale_encoding == "ue8m0":
        exponent = _pow2_ceil_exponent(q)
        values, scale = _pow2(exponent), _ue8m0_bytes(exponent)
    else:
        values = scale = q
    codes = _to_e4m3_bytes(padded / values[:, None, :, None]).view(gm * bm, gn * bn)
    return codes[:n_out, :n_in].contiguous().view(torch.float8_e4m3fn), scale


# ---------------------------------------------------------------- FP4 E2M1


def check_fp4(packed: torch.Tensor, scale: torch.Tensor) -> None:
    """Refuse, naming it, anything that is not a canonical packed FP4 weight and its scales."""
    if packed.dtype != torch.int8 or packed.dim() < 1:
        raise ValueError(f"FP4 weights are packed int8 [..., in/2], not {packed.dtype} {list(packed.shape)}")
    if scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"FP4 scales are float8_e8m0fnu, not {scale.dtype} (ue8m0_from gives the canonical tensor)")
    n_in = 2 * packed.shape[-1]
    if n_in % FP4_GROUP:
        raise ValueError(f"FP4 rows of {n_in} inputs do not split into scale groups of {FP4_GROUP}")
    want = (*packed.shape[:-1], n_in // FP4_GROUP)
    if tuple(scale.shape) != want:
        raise ValueError(f"FP4 weight {list(packed.shape)} (packed) needs a scale of shape {list(want)}, "
                         f"not {list(scale.shape)}")


def decode_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [..., in] values of packed E2M1 weights [..., in/2] with UE8M0 scales [..., in/32], exact."""
    check_fp4(packed, scale)
    elements = _unpack_e2m1(packed.view(torch.uint8), FP4_GROUP)  # [..., in/32, 32]
    return _mx_decode(elements, scale.view(torch.uint8)).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int8 [..., in/2], float8_e8m0fnu scale [..., in/32]) of float weights w [..., in].

    Scale ``2^ceil(log2(amax / 6))`` per 32 inputs (an all-zero group gets 2^-126), codes
    ``E2M1(w / scale)`` nearest with ties to the even code; the sign bit is w's own.
    """
    if w.dim() < 1 or w.shape[-1] % FP4_GROUP:
        raise ValueError(f"FP4 rows must hold a multiple of {FP4_GROUP} inputs, not shape {list(w.shape)}")
    _refuse_non_finite(w, "the FP4 weight")
    groups = _blocks(w.to(torch.float32), FP4_GROUP)
    exponent = _pow2_ceil_exponent(groups.abs().amax(dim=-1).clamp_min(_FP4_MIN_AMAX) / _E2M1_MAX)
    q = groups * _pow2(-exponent).unsqueeze(-1)  # exact: a power of two
    packed = _pack_e2m1(q, torch.signbit(q), torch.ones_like(q, dtype=torch.bool), w.shape)
    return packed.view(torch.int8), _ue8m0_bytes(exponent)


# ---------------------------------------------------------------- activations


def act_quant_e4m3(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """DeepSeek's activation rule, quantized and decoded again: float32, the shape of x.

    Per token (every index but the last) and per ``group`` channels: ``s =
    2^ceil(log2(max(amax, 1e-4) / 448))``, ``q = E4M3(clamp(x / s, ±448))`` nearest even,
    result ``q * s`` (exact in float32). A last partial group is its own group. A group
    holding inf or NaN decodes to NaN (DeepSeek's rule leaves it undefined).
    """
    xf = x.to(torch.float32)
    n = xf.shape[-1]
    padded = F.pad(xf, (0, -n % group))
    groups = _blocks(padded, group)
    finite = torch.isfinite(groups).all(dim=-1, keepdim=True)
    amax = torch.where(finite, groups, 0.0).abs().amax(dim=-1, keepdim=True)
    scale = _pow2(_pow2_ceil_exponent(amax.clamp_min(ACT_MIN_AMAX) / _E4M3_MAX))
    q = _e4m3_bytes_to_f32(_to_e4m3_bytes(groups / scale))
    out = torch.where(finite, q * scale, float("nan"))
    return out.reshape(padded.shape)[..., :n]
