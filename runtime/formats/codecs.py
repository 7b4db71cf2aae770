"""CPU reference encoders/decoders for the KV-cache row formats.

Every format turns float32 rows ``x[..., dim]`` into ``uint8[..., row_bytes(dim)]``
and back. The code is plain vectorised torch (no per-element Python loops) because
it runs inside custom ops on hot paths; it also works unchanged on other devices.
A format's name says whose convention its bytes follow, and so does its ``convention``,
which packages record (manifest ``cache_formats``) and the reader checks:

* ``dsv41_mxfp8``, ``dsv41_nvfp4`` and ``dsv41_mxfp4``: DeepSeek V4.1's window record,
  compressed record and index key, as FlashInfer writes them (dsv41.py documents them and
  says where FlashInfer leaves them undefined). The V4.1 recipes store their caches in these.
* ``ocp_mxfp8`` and ``ocp_mxfp4``: OCP Microscaling (MX) v1.0 blocks, below.
* ``bf16`` and ``fp32``: bit patterns.

Byte layouts of one row (all multi-byte values little-endian):

``ocp_mxfp8`` (OCP MX, block 32) -- ``dim + dim/32`` bytes (512 dims -> 528)
    ``dim`` bytes of FP8 E4M3 elements in element order, then one UE8M0 scale byte
    per block of 32. Shared exponent ``e = floor(log2(amax)) - 8`` (8 = emax of
    E4M3), clamped to [-127, 127]; scale byte ``e + 127``; element
    ``E4M3(clamp(x * 2^-e, -448, 448))`` rounded to nearest even, so values between
    448 * 2^e and amax saturate (dsv41_mxfp8 takes the next power of two instead).
    Decode: ``E4M3 * 2^(scale - 127)``.
    Edge cases: amax == 0 -> scale 0x00 and all elements 0x00. Any NaN in a
    block -> scale 0xFF and every element 0x7F (canonical positive NaN); a 0xFF
    scale decodes to NaN for the whole block. +-inf counts as float32 max for
    the scale and saturates to +-448. Within a block with a nonzero amax, -0.0
    and negative values that round to zero keep the sign the cast gives (0x80).

``ocp_mxfp4`` (OCP MX, block 32) -- ``dim/2 + dim/32`` bytes (128 dims -> 68)
    ``dim/2`` bytes of packed FP4 E2M1 (element 2i in the low nibble, 2i+1 in the
    high nibble), then one UE8M0 scale byte per block of 32. Shared
    exponent ``e = floor(log2(amax)) - 2`` (2 = emax of E2M1: 6 = 1.5 * 2^2),
    clamped to [-127, 127]; scale byte ``e + 127``; element
    ``E2M1(clamp(x * 2^-e, -6, 6))`` rounded to nearest with ties to the even code.
    Decode: ``e2m1 * 2^(scale - 127)``.
    Edge cases as ocp_mxfp8: amax == 0 -> scale 0x00 and all nibbles 0. Any NaN in a
    block -> scale 0xFF and nibbles 0; a 0xFF scale decodes to NaN for the whole
    block. +-inf counts as float32 max for the scale and saturates to +-6. Within
    a block with a nonzero amax the sign bit 0x8 is the input's sign bit, as the
    E4M3 cast gives ocp_mxfp8: -0.0 and negative values that round to zero encode as
    0x8.

``bf16`` (block 1) -- ``2 * dim`` bytes: the bfloat16 bit pattern (RNE cast).

``fp32`` (block 1) -- ``4 * dim`` bytes: the float32 bit pattern, exact.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["Format", "FORMATS", "get_format", "check_dim"]

from b12x_toolchain.runtime.formats import dsv41
from b12x_toolchain.runtime.formats.minifloat import (
    _E2M1_EMAX,
    _E4M3_EMAX,
    _blocks,
    _e4m3_bytes_to_f32,
    _mx_decode,
    _mx_scales,
    _pack_e2m1,
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


def _decode_e4m3_scaled_fp4(data: torch.Tensor, dim: int) -> torch.Tensor:
    s = _e4m3_bytes_to_f32(data[..., dim // 2 :])  # 0x7F -> NaN for the whole block
    elems = _unpack_e2m1(data[..., : dim // 2], 16)
    return (elems * s.unsqueeze(-1)).reshape(*data.shape[:-1], dim)


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
    convention: str  # whose bytes these are: packages record it, the reader compares
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


_OCP_MX = "OCP Microscaling (MX) v1.0"
FORMATS: dict[str, Format] = {
    "dsv41_mxfp8": Format("dsv41_mxfp8", 32, 33, dsv41.WINDOW_CONVENTION, dsv41.encode_window, _decode_mxfp8),
    "dsv41_nvfp4": Format("dsv41_nvfp4", 16, 9, dsv41.COMPRESSED_CONVENTION, dsv41.encode_compressed,
                          _decode_e4m3_scaled_fp4),
    "dsv41_mxfp4": Format("dsv41_mxfp4", 32, 17, dsv41.INDEX_KEY_CONVENTION, dsv41.encode_index_key, _decode_mxfp4),
    "ocp_mxfp8": Format("ocp_mxfp8", 32, 33, _OCP_MX, _encode_mxfp8, _decode_mxfp8),
    "ocp_mxfp4": Format("ocp_mxfp4", 32, 17, _OCP_MX, _encode_mxfp4, _decode_mxfp4),
    "bf16": Format("bf16", 1, 2, "bfloat16 bits", _bit_encoder(torch.bfloat16), _bit_decoder(torch.bfloat16)),
    "fp32": Format("fp32", 1, 4, "float32 bits", _bit_encoder(torch.float32), _bit_decoder(torch.float32)),
}
RENAMED = {
    "mxfp8": "dsv41_mxfp8 (DeepSeek V4.1's window record) or ocp_mxfp8 (the OCP MX rule it followed)",
    "nvfp4": "dsv41_nvfp4 (DeepSeek V4.1's compressed record; its zero-block and -0.0 rules differ)",
    "mxfp4": "dsv41_mxfp4 (DeepSeek V4.1's index key) or ocp_mxfp4 (the OCP MX rule it followed)",
}
"""Format names of b12x before the V4.1 records, and what replaced each."""


def renamed(name) -> str | None:
    """"'NAME' was renamed: use ..." for a format name from before the V4.1 records, else None."""
    if isinstance(name, str) and name in RENAMED:
        return f"{name!r} was renamed: use {RENAMED[name]}"
    return None


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        if renamed(name):
            raise ValueError(f"KV-cache format {renamed(name)}") from None
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
