"""CPU reference encoders/decoders for the KV-cache row formats.

Every format turns float32 rows ``x[..., dim]`` into ``uint8[..., row_bytes(dim)]``
and back. The code is plain vectorised torch (no per-element Python loops) because
it runs inside custom ops on hot paths; it also works unchanged on other devices.

Byte layouts of one row (all multi-byte values little-endian):

``mxfp8`` (OCP MX, block 32) -- ``dim + dim/32`` bytes (512 dims -> 528)
    ``dim`` bytes of FP8 E4M3 elements in element order, then one UE8M0 scale byte
    per block of 32. Shared exponent ``e = floor(log2(amax)) - 8`` (8 = emax of
    E4M3), clamped to [-127, 127]; scale byte ``e + 127``; element
    ``E4M3(clamp(x * 2^-e, -448, 448))`` rounded to nearest even. Decode:
    ``E4M3 * 2^(scale - 127)``.
    Edge cases: amax == 0 -> scale 0x00 and all elements 0x00. Any NaN in a
    block -> scale 0xFF and every element 0x7F (canonical positive NaN); a 0xFF
    scale decodes to NaN for the whole block. +-inf counts as float32 max for
    the scale and saturates to +-448. Within a block with a nonzero amax, -0.0
    and negative values that round to zero keep the sign the cast gives (0x80).

``nvfp4`` (block 16) -- ``dim/2 + dim/16`` bytes (512 dims -> 288)
    ``dim/2`` bytes of packed FP4 E2M1 (element 2i in the low nibble, 2i+1 in the
    high nibble), then one FP8 E4M3 scale byte per block of 16. No global scale.
    ``s = E4M3(clamp(amax / 6, 0, 448))``; element ``E2M1(x / s)`` rounded to
    nearest with ties to the even code, saturating at 6; sign bit 0x8 set iff
    ``x < 0`` (so -0.0 encodes as 0x0, and a negative value rounding to zero as
    0x8). Decode: ``e2m1 * s``.
    Edge cases: ``s == 0`` (amax / 6 <= 2^-10: half the smallest E4M3 step) -> all
    nibbles 0. Any NaN in a block -> scale 0x7F (E4M3 NaN) and nibbles 0; it
    decodes to NaN for the whole block. +-inf counts as float32 max.

``mxfp4`` (OCP MX, block 32) -- ``dim/2 + dim/32`` bytes (128 dims -> 68)
    ``dim/2`` bytes of packed FP4 E2M1 (element 2i in the low nibble, 2i+1 in the
    high nibble, as nvfp4), then one UE8M0 scale byte per block of 32. Shared
    exponent ``e = floor(log2(amax)) - 2`` (2 = emax of E2M1: 6 = 1.5 * 2^2),
    clamped to [-127, 127]; scale byte ``e + 127``; element
    ``E2M1(clamp(x * 2^-e, -6, 6))`` rounded to nearest with ties to the even code.
    Decode: ``e2m1 * 2^(scale - 127)``.
    Edge cases as mxfp8: amax == 0 -> scale 0x00 and all nibbles 0. Any NaN in a
    block -> scale 0xFF and nibbles 0; a 0xFF scale decodes to NaN for the whole
    block. +-inf counts as float32 max for the scale and saturates to +-6. Within
    a block with a nonzero amax the sign bit 0x8 is the input's sign bit, as the
    E4M3 cast gives mxfp8: -0.0 and negative values that round to zero encode as
    0x8 (nvfp4 differs for -0.0, which it encodes as 0x0).

``bf16`` (block 1) -- ``2 * dim`` bytes: the bfloat16 bit pattern (RNE cast).

``fp32`` (block 1) -- ``4 * dim`` bytes: the float32 bit pattern, exact.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["Format", "FORMATS", "get_format", "check_dim"]

from b12x_toolchain.runtime.formats.minifloat import (  # noqa: F401  (tests read a few)
    _E2M1_EMAX,
    _E2M1_MAX,
    _E2M1_UP_IF_GE,
    _E2M1_UP_IF_GT,
    _E2M1_VALUES,
    _E4M3_EMAX,
    _E4M3_MAX,
    _F32_MAX,
    _block_amax,
    _blocks,
    _e4m3_bytes_to_f32,
    _e2m1_codes,
    _e4m3_cast,
    _mx_decode,
    _mx_scales,
    _pack_e2m1,
    _pow2_table,
    _to_e4m3_bytes,
    _unpack_e2m1,
)


def _encode_mxfp8(x: torch.Tensor, out: torch.Tensor) -> None:
    dim = x.shape[-1]
    xb = _blocks(x, 32)
    scale, inv_scale, zero, nan = _mx_scales(xb, _E4M3_EMAX)
    # x * 2^-e is exact for every value that can land above zero in E4M3.
    elems = _to_e4m3_bytes(xb * inv_scale)
    elems = torch.where(zero.unsqueeze(-1), 0, elems).to(torch.uint8)
    elems = torch.where(nan.unsqueeze(-1), 0x7F, elems).to(torch.uint8)
    out[..., :dim].copy_(elems.reshape(x.shape))
    out[..., dim:].copy_(scale)


def _decode_mxfp8(data: torch.Tensor, dim: int) -> torch.Tensor:
    elems = _blocks(_e4m3_bytes_to_f32(data[..., :dim]), 32)
    return _mx_decode(elems, data[..., dim:]).reshape(*data.shape[:-1], dim)


def _encode_nvfp4(x: torch.Tensor, out: torch.Tensor) -> None:
    dim = x.shape[-1]
    xb = _blocks(x, 16)
    amax, nan = _block_amax(xb)
    scale = _to_e4m3_bytes(amax / _E2M1_MAX)  # amax >= 0, so only the top clamp acts
    s = _e4m3_bytes_to_f32(scale).unsqueeze(-1)
    live = s > 0
    # Dividing by 1 where s == 0 avoids 0/0; those blocks are zeroed below.
    q = xb / torch.where(live, s, torch.ones_like(s))
    packed = _pack_e2m1(q, xb < 0, live & ~nan.unsqueeze(-1), x.shape)
    scale = torch.where(nan, 0x7F, scale).to(torch.uint8)
    out[..., : dim // 2].copy_(packed)
    out[..., dim // 2 :].copy_(scale)


def _decode_nvfp4(data: torch.Tensor, dim: int) -> torch.Tensor:
    s = _e4m3_bytes_to_f32(data[..., dim // 2 :])  # 0x7F -> NaN for the whole block
    elems = _unpack_e2m1(data[..., : dim // 2], 16)
    return (elems * s.unsqueeze(-1)).reshape(*data.shape[:-1], dim)


def _encode_mxfp4(x: torch.Tensor, out: torch.Tensor) -> None:
    dim = x.shape[-1]
    xb = _blocks(x, 32)
    scale, inv_scale, zero, nan = _mx_scales(xb, _E2M1_EMAX)
    # x * 2^-e is exact wherever it matters: |x * 2^-e| < 8, and a product that loses
    # bits to float32 underflow is below 2^-126, far under the first midpoint 0.25.
    live = ~(zero | nan).unsqueeze(-1)
    packed = _pack_e2m1(xb * inv_scale, torch.signbit(xb), live, x.shape)
    out[..., : dim // 2].copy_(packed)
    out[..., dim // 2 :].copy_(scale)


def _decode_mxfp4(data: torch.Tensor, dim: int) -> torch.Tensor:
    elems = _unpack_e2m1(data[..., : dim // 2], 32)
    return _mx_decode(elems, data[..., dim // 2 :]).reshape(*data.shape[:-1], dim)


def _bit_encoder(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def encode(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x.to(dtype).contiguous().view(torch.uint8))

    return encode


def _bit_decoder(dtype: torch.dtype) -> Callable[[torch.Tensor, int], torch.Tensor]:
    def decode(data: torch.Tensor, dim: int) -> torch.Tensor:
        # copy=True so the result never aliases the caller's cache bytes.
        return data.contiguous().view(dtype).to(torch.float32, copy=True)

    return decode


@dataclass(frozen=True)
class Format:
    """A KV-cache row format: ``block`` elements become ``block_bytes`` bytes."""

    name: str
    block: int
    block_bytes: int
    _encode: Callable[[torch.Tensor, torch.Tensor], None]
    _decode: Callable[[torch.Tensor, int], torch.Tensor]

    def row_bytes(self, dim: int) -> int:
        check_dim(self, dim)
        return dim // self.block * self.block_bytes

    def encode(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Encode ``x[..., dim]`` (cast to float32) into ``uint8[..., row_bytes(dim)]``.

        With ``out`` (uint8, right shape, any strides, e.g. a cache slice) the
        bytes are written there and ``out`` is returned.
        """
        x = x.to(torch.float32)
        if x.dim() == 0:
            raise ValueError(f"{self.name}: encode needs at least one dimension")
        shape = (*x.shape[:-1], self.row_bytes(x.shape[-1]))
        if out is None:
            out = torch.empty(shape, dtype=torch.uint8, device=x.device)
        elif out.dtype != torch.uint8 or tuple(out.shape) != shape:
            raise ValueError(
                f"{self.name}: out must be uint8 of shape {list(shape)}, "
                f"got {out.dtype} {list(out.shape)}"
            )
        self._encode(x, out)
        return out

    def decode(self, data: torch.Tensor, dim: int) -> torch.Tensor:
        """Decode ``uint8[..., row_bytes(dim)]`` into float32 ``[..., dim]``; reads only."""
        nbytes = self.row_bytes(dim)
        if data.dtype != torch.uint8 or data.dim() == 0 or data.shape[-1] != nbytes:
            raise ValueError(
                f"{self.name}: expected uint8 [..., {nbytes}] for dim {dim}, "
                f"got {data.dtype} {list(data.shape)}"
            )
        return self._decode(data, dim)


FORMATS: dict[str, Format] = {
    "mxfp8": Format("mxfp8", 32, 33, _encode_mxfp8, _decode_mxfp8),
    "nvfp4": Format("nvfp4", 16, 9, _encode_nvfp4, _decode_nvfp4),
    "mxfp4": Format("mxfp4", 32, 17, _encode_mxfp4, _decode_mxfp4),
    "bf16": Format("bf16", 1, 2, _bit_encoder(torch.bfloat16), _bit_decoder(torch.bfloat16)),
    "fp32": Format("fp32", 1, 4, _bit_encoder(torch.float32), _bit_decoder(torch.float32)),
}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown KV-cache format {name!r}; supported: {', '.join(sorted(FORMATS))}"
        ) from None


def check_dim(fmt: Format | str, dim: int) -> None:
    """Raise ValueError unless ``dim`` is a positive multiple of the format's block."""
    if isinstance(fmt, str):
        fmt = get_format(fmt)
    try:
        ok = not isinstance(dim, bool) and operator.index(dim) > 0 and dim % fmt.block == 0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(
            f"{fmt.name}: dim {dim!r} must be a positive multiple of the block size {fmt.block}"
        )
