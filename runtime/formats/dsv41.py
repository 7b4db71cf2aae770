"""DeepSeek V4.1's cache records, byte for byte as FlashInfer's reference encoder writes them.

The pinned flashinfer-python (``FLASHINFER_PIN``) defines the two records DeepSeek V4.1
attention kernels read, in its pure-torch ``pack_deepseek_v41_cache_reference``
(``flashinfer/experimental/b12x/attention/_shared/mla/compressed_reference.py``). These
encoders give its bytes for every finite input; tests/runtime/formats/test_flashinfer_records.py
loads that function from the installed wheel and compares.

``dsv41_mxfp8`` -- the window (``swa``) record, ``dim + dim/32`` bytes (512 dims -> 528)
    ``dim`` E4M3 elements, then one UE8M0 scale byte per block of 32. Scale ``2^e`` with
    ``e = ceil(log2(q))``, ``q = max(amax, 1e-4) / 448`` in float32, where log2 is the
    float32 log2 the reference calls: it rounds to the nearest float32, so for ``q`` one or
    a few ulps above a power of two ``2^k`` it returns ``k`` exactly and ``e`` stays ``k``
    (``_swallowed`` counts those ulps; FlashInfer's CUDA writers take the ceiling on the
    bits instead and give ``k + 1`` there). Scale byte ``e + 127``; element
    ``E4M3(clamp(x / 2^e, -448, 448))``, nearest even. No element saturates except in
    those few-ulp blocks, where the largest saturates by under one part in 2^21.
    Decode ``E4M3 * 2^(byte - 127)``.
    Where the reference is undefined -- it casts ``ceil(log2(inf or NaN))`` to int32 -- b12x
    takes ``amax`` over the finite values with +-inf counted as float32 max (scale byte
    247, so +-inf encodes as +-448 * 2^120 and decodes back to +-inf) and writes NaN
    elements as 0x7F; the block's other elements encode as without the NaN.

``dsv41_nvfp4`` -- the compressed (``indexed``) record, ``dim/2 + dim/16`` bytes (512 -> 288)
    ``dim/2`` bytes of packed E2M1 (element 2i in the low nibble), then one E4M3 scale byte
    per block of 16: ``s = E4M3(min(max(amax, 6 * 2^-9) / 6, 448))``, so an all-zero
    block still has the scale 2^-9 (byte 0x01). Element ``E2M1(x / s)`` by true division
    (a rounded reciprocal would move exact midpoints off their ties), nearest with ties to
    the even code, saturating at 6; the sign bit is the input's sign bit, so -0.0 and
    negative values that round to zero encode as 0x8. +-inf gives ``s = 448`` and +-6.
    A block holding a NaN gets scale 0x7F (E4M3 NaN) and every nibble 0x7, the
    reference's bytes (its bucketize puts NaN above every midpoint); it decodes to NaN.

``dsv41_mxfp4`` -- the indexer's key, ``dim/2 + dim/32`` bytes (128 dims -> 68)
    ``dim/2`` bytes of packed E2M1, then one UE8M0 scale byte per block of 32, as FlashInfer's
    DeepSeek indexer writes its MXFP4 keys (``dsa_indexer/mxfp4.py``, ``_Quantize``; the wheel
    has no pure-torch encoder for keys, only ``pow2_ceil_ue8m0_torch``, its replica of the
    scale rounding, which the tests compare against). ``q = max(amax, 6 * 2^-126) * (1/6)``
    with the float32 reciprocal, rounded up to a power of two on the bits: scale ``2^e``, byte
    ``e + 127``. Element ``E2M1(x * 2^-e)``, nearest with ties to the even code, saturating
    at 6, sign bit the input's. Decode ``e2m1 * 2^(byte - 127)``, as ocp_mxfp4 (whose scale is
    ``2^(floor(log2 amax) - 2)`` instead, so its largest values saturate).
    FlashInfer's writer leaves non-finite input undefined (its amax skips NaN, and an inf
    amax makes scale byte 0xFF with a zero reciprocal, so inf * 0); b12x counts +-inf as
    float32 max (+-6 at scale byte 253) and writes a block holding a NaN as scale 0xFF,
    nibbles 0, decoding to NaN, as ocp_mxfp4.
"""

from __future__ import annotations

import math

import torch

from b12x_toolchain.runtime.formats.minifloat import (
    _E4M3_MAX,
    _block_amax,
    _blocks,
    _e2m1_codes,
    _e4m3_bytes_to_f32,
    _pack_e2m1,
    _pow2_table,
    _to_e4m3_bytes,
)

FLASHINFER_PIN = "0.7.4"
"""The flashinfer-python release whose V4.1 records these encoders reproduce (the tests install it)."""

WINDOW_CONVENTION = f"DeepSeek V4.1 window record (swa), flashinfer-python {FLASHINFER_PIN}"
COMPRESSED_CONVENTION = f"DeepSeek V4.1 compressed record (indexed), flashinfer-python {FLASHINFER_PIN}"
INDEX_KEY_CONVENTION = f"DeepSeek V4.1 MXFP4 index key (dsa_indexer), flashinfer-python {FLASHINFER_PIN}"

_WINDOW_MIN_AMAX = 1e-4  # the reference's clamp; torch applies it as the float32 nearest 1e-4
_COMPRESSED_MIN_AMAX = 6 * 2.0**-9  # amax / 6 >= 2^-9, the smallest E4M3 subnormal
_INDEX_MIN_AMAX = 6 * 2.0**-126  # keeps the key scale a normal float32
_SIXTH = torch.tensor(1 / 6, dtype=torch.float32)  # the writer multiplies by this rounded reciprocal
_K_MIN, _K_MAX = -30, 130  # float32 exponents q can have: 1e-4 / 448 ~ 2^-22, f32 max / 448 ~ 2^119


def _swallowed(k: int) -> int:
    """How many ulps above 2^k a float32 q can be while the nearest float32 to log2(q) is k.

    log2(2^k (1 + m 2^-23)) = k + log2(1 + m 2^-23) rounds back to k while the excess is
    under half the float32 spacing at k (the binade below |k| when k < 0 is minus a power
    of two). The excess is irrational for m > 0, so there are no ties.
    """
    if k == 0:
        return 0  # log2(q) is then the small positive excess itself, never 0
    n = abs(k)
    binade = n.bit_length() - 1 - (1 if k < 0 and n & (n - 1) == 0 else 0)
    half_spacing = 2.0 ** (binade - 24)
    return math.ceil(math.expm1(half_spacing * math.log(2)) * 2**23) - 1


# Built once: the encoders run inside custom ops on every write.
_SWALLOWED = torch.tensor([_swallowed(k) for k in range(_K_MIN, _K_MAX + 1)], dtype=torch.int64)


def window_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int64 block exponents e of the window record for float32 block amax values (finite)."""
    q = amax.clamp_min(_WINDOW_MIN_AMAX) / _E4M3_MAX
    bits = q.view(torch.int32).to(torch.int64)
    k = (bits >> 23) - 127
    mantissa = bits & 0x7FFFFF
    swallowed = _SWALLOWED.to(amax.device)[k - _K_MIN]
    return k + (mantissa > swallowed).to(torch.int64)


def encode_window(x: torch.Tensor, out: torch.Tensor) -> None:
    dim = x.shape[-1]
    xb = _blocks(x, 32)
    amax, _ = _block_amax(xb)
    e = window_exponents(amax)
    # x * 2^-e equals the reference's x / 2^e: both are the correctly rounded same value.
    elems = _to_e4m3_bytes(xb * _pow2_table(x.device)[127 - e].unsqueeze(-1))
    elems = torch.where(torch.isnan(xb), 0x7F, elems).to(torch.uint8)
    out[..., :dim].copy_(elems.reshape(x.shape))
    out[..., dim:].copy_((e + 127).to(torch.uint8))


def encode_compressed(x: torch.Tensor, out: torch.Tensor) -> None:
    dim = x.shape[-1]
    xb = _blocks(x, 16)
    amax, nan = _block_amax(xb)
    scale = _to_e4m3_bytes(amax.clamp_min(_COMPRESSED_MIN_AMAX) / 6.0)  # the cast clamps at 448
    q = xb / _e4m3_bytes_to_f32(scale).unsqueeze(-1)  # the scale is at least 2^-9: never 0/0
    nib = _e2m1_codes(q) | (torch.signbit(xb).to(torch.uint8) << 3)
    nib = torch.where(nan.unsqueeze(-1), 0x7, nib).to(torch.uint8).reshape(x.shape)
    out[..., : dim // 2].copy_(nib[..., 0::2] | (nib[..., 1::2] << 4))
    out[..., dim // 2 :].copy_(torch.where(nan, 0x7F, scale).to(torch.uint8))


def index_key_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int64 block exponents e of the index key for float32 block amax values (finite)."""
    q = amax.clamp_min(_INDEX_MIN_AMAX) * _SIXTH.to(amax.device)
    bits = q.view(torch.int32).to(torch.int64)
    return (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int64)


def encode_index_key(x: torch.Tensor, out: torch.Tensor) -> None:
    dim = x.shape[-1]
    xb = _blocks(x, 32)
    amax, nan = _block_amax(xb)
    e = index_key_exponents(amax)
    # x * 2^-e is exact wherever it matters (a product under 2^-126 is far below the first midpoint).
    q = xb * _pow2_table(x.device)[127 - e].unsqueeze(-1)
    out[..., : dim // 2].copy_(_pack_e2m1(q, torch.signbit(xb), ~nan.unsqueeze(-1), x.shape))
    out[..., dim // 2 :].copy_(torch.where(nan, 0xFF, e + 127).to(torch.uint8))
