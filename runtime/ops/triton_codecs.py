"""Triton device functions for the KV-cache row formats, bit-exact with `runtime/formats`.

Every rounding decision is made with integer arithmetic on the float32 bit pattern, so
the result does not depend on how a backend converts floats: the CPU interpreter, a GPU
and the torch reference agree by construction. In particular

* E4M3 is round-to-nearest-even on the float32 bits with explicit saturation to ±448
  (the reference clamps before its cast; a GPU `cvt.satfinite` would agree, an
  interpreter cast through numpy need not); MXFP4's E2M1 elements are rounded on the
  bits the same way (one helper, `_minifloat_code`, serves both), saturating to ±6;
* NaN never goes through a cast: the reference writes canonical 0x7F for a NaN block,
  while a CPU cast keeps the NaN's sign (0xFF) and CUDA does not, so NaN blocks are
  detected on the bits and written explicitly;
* subnormal float32 inputs are handled on the bits too, so flush-to-zero modes cannot
  change a code.

The V4.1 window scale needs `max(amax, 1e-4) / 448` and the compressed one `amax / 6`;
those divisions and the compressed record's `x / scale` use `div_rn`
(IEEE round-to-nearest, as torch's division) rather than Triton's default approximate
division. Flushing subnormal quotients to zero cannot change a code: any quotient below
2^-10 encodes as zero either way, and signs are read from the input bits.

Tiles are `[TOK, DIM_P2]` with DIM_P2 a power of two at least the row's dim; padding
elements must be loaded as 0.0 (whole zero blocks, never stored).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _msb(m):
    """Index of the highest set bit of m in [1, 2^24) (result for 0 is 0)."""
    n = tl.zeros_like(m)
    big = m >= (1 << 16)
    n += tl.where(big, 16, 0)
    m = tl.where(big, m >> 16, m)
    big = m >= (1 << 8)
    n += tl.where(big, 8, 0)
    m = tl.where(big, m >> 8, m)
    big = m >= (1 << 4)
    n += tl.where(big, 4, 0)
    m = tl.where(big, m >> 4, m)
    big = m >= (1 << 2)
    n += tl.where(big, 2, 0)
    m = tl.where(big, m >> 2, m)
    n += tl.where(m >= 2, 1, 0)
    return n


@triton.jit
def _minifloat_code(bits, e, MAN: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
                    MAX_SIG: tl.constexpr, MAX_CODE: tl.constexpr, SIGN: tl.constexpr):
    """Code of the float32 with these bits times 2^-e in a small float format.

    The format has MAN mantissa bits, smallest normal exponent EMIN (subnormal grid
    2^(EMIN - MAN) below it) and largest finite value MAX_SIG * 2^(EMAX - 23), whose code
    is MAX_CODE; the sign goes to bit SIGN. Round to nearest even, saturating to the
    largest finite value; inf saturates too. NaN is the caller's business (its code here
    is meaningless). `e` broadcasts against `bits`.
    """
    sign = (bits >> 31) & 1
    ex = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    sub = ex == 0
    norm = 23 - _msb(man)
    # |x| = sig * 2^lsb with sig normalised to [2^23, 2^24) (sig = 0 for zeros).
    sig = tl.where(sub, man << norm, man | 0x800000)
    lsb = tl.where(sub, -149 - norm, ex - 150) - e
    top = lsb + 23  # floor(log2 |x * 2^-e|)
    sat = (ex == 255) | (top > EMAX) | ((top == EMAX) & (sig > MAX_SIG))
    # Keep MAN + 1 significant bits down to 2^EMIN; below, the grid is 2^(EMIN - MAN).
    # A drop of 25 leaves nothing but a zero guard bit: everything that small rounds to 0.
    drop = tl.minimum(tl.where(top >= EMIN, 23 - MAN, 23 - MAN + EMIN - top), 25)
    kept = sig >> (drop - 1)  # one guard bit
    sticky = (kept << (drop - 1)) != sig
    r = kept >> 1
    r += (kept & 1) & (sticky.to(tl.int32) | (r & 1))
    # r == 2^(MAN + 1) carries into the exponent by itself: the biased exponent is
    # top + 1 - EMIN, and r counts the implicit bit once too often.
    code = tl.where(top >= EMIN, ((top + 1 - EMIN) << MAN) + r - (1 << MAN), r)
    code = tl.where(sat, MAX_CODE, code)
    return code | (sign << SIGN)


@triton.jit
def e4m3_code(bits, e):
    """E4M3 code (0..255, sign in bit 7) of the float32 with these bits times 2^-e.

    Round to nearest even, saturating to ±448 (1.75 * 2^8, code 0x7E); inf saturates too.
    NaN is the caller's business (its code here is meaningless). `e` broadcasts against
    `bits`.
    """
    return _minifloat_code(bits, e, 3, -6, 8, 0xE00000, 0x7E, 7)


@triton.jit
def e2m1_code(bits, e):
    """E2M1 nibble (0..15, sign in bit 3) of the float32 with these bits times 2^-e.

    Round to nearest with ties to the even code, saturating to ±6 (1.5 * 2^2, code 7);
    inf saturates too. The sign is the input's sign bit (-0.0 gives 0x8). NaN is the
    caller's business.
    """
    return _minifloat_code(bits, e, 1, 0, 2, 0xC00000, 7, 3)


@triton.jit
def e4m3_value(code):
    """float32 value of an E4M3 code (int32); 0x7F / 0xFF decode to NaN."""
    sign = (code >> 7) & 1
    ex = (code >> 3) & 0xF
    man = code & 7
    normal = (((ex + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(ex == 0, man.to(tl.float32) * 0.001953125, normal)  # m * 2^-9 is exact
    mag = tl.where((code & 0x7F) == 0x7F, float("nan"), mag)
    return _with_sign(mag, sign)


@triton.jit
def _with_sign(mag, sign):
    """mag with its sign bit set where sign == 1; `-x` is `0 - x` and would lose -0.0."""
    return (mag.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _magnitude(bits):
    """(|x| bits with NaN -> 0 and inf -> float32 max, NaN mask): the block-amax inputs."""
    mag = bits & 0x7FFFFFFF
    nan = mag > 0x7F800000
    mag = tl.where(nan, 0, tl.minimum(mag, 0x7F7FFFFF))
    return mag, nan


@triton.jit
def _per_block(v, TOK: tl.constexpr, NB: tl.constexpr, B: tl.constexpr):
    """Broadcast [TOK, NB] per-block values to [TOK, NB * B] elements."""
    return tl.reshape(tl.broadcast_to(v[:, :, None], (TOK, NB, B)), (TOK, NB * B))


@triton.jit
def _mx_scales(bits, EMAX: tl.constexpr, TOK: tl.constexpr, DIM_P2: tl.constexpr):
    """OCP MX block scales of float32 bits [TOK, DIM_P2] for elements whose emax is EMAX.

    Returns (UE8M0 scale bytes [TOK, DIM_P2 // 32], and per element: the block's e, 1 where
    the block is all zeros, 1 where it holds a NaN). Scale bytes are 0x00 for a zero block
    and 0xFF for a NaN one.
    """
    NB: tl.constexpr = DIM_P2 // 32
    mag, nan = _magnitude(bits)
    amax = tl.max(tl.reshape(mag, (TOK, NB, 32)), axis=2)
    nan_b = tl.max(tl.reshape(nan.to(tl.int32), (TOK, NB, 32)), axis=2) > 0
    # floor(log2 amax) - EMAX from the biased exponent; a subnormal amax clamps to -127 as well.
    e = tl.maximum((amax >> 23) - 127 - EMAX, -127)
    scale = tl.where(nan_b, 0xFF, tl.where(amax == 0, 0, e + 127))
    zero = _per_block((amax == 0).to(tl.int32), TOK, NB, 32)
    return scale, _per_block(e, TOK, NB, 32), zero, _per_block(nan_b.to(tl.int32), TOK, NB, 32)


@triton.jit
def _ue8m0_value(scales):
    """2^(s - 127) as float32 (s = 0 is the float32 subnormal 2^-127); 0xFF -> NaN."""
    pow2 = tl.where(scales == 0, 0x00400000, scales << 23).to(tl.float32, bitcast=True)
    return tl.where(scales == 0xFF, float("nan"), pow2)


@triton.jit
def mxfp8_encode(bits, TOK: tl.constexpr, DIM_P2: tl.constexpr):
    """(element codes [TOK, DIM_P2], scale bytes [TOK, DIM_P2 // 32]) of float32 bits."""
    scale, e, zero, nan = _mx_scales(bits, 8, TOK, DIM_P2)  # 8 = emax of E4M3
    codes = e4m3_code(bits, e)
    codes = tl.where(zero == 1, 0, codes)
    codes = tl.where(nan == 1, 0x7F, codes)
    return codes, scale


@triton.jit
def mxfp8_decode(codes, scales, TOK: tl.constexpr, DIM_P2: tl.constexpr):
    """float32 [TOK, DIM_P2] from element codes and UE8M0 scale bytes (0xFF -> NaN)."""
    return e4m3_value(codes) * _per_block(_ue8m0_value(scales), TOK, DIM_P2 // 32, 32)


@triton.jit
def _swallowed(k):
    """`dsv41._swallowed(k)` for |k| < 128: ulps above 2^k that float32 log2 rounds back to k.

    The count depends only on the binade of |k| (one lower when k < 0 is minus a power of
    two): floor(ln 2 * 2^(binade - 1)) for binades 2..6, none below.
    """
    n = tl.abs(k)
    binade = _msb(n) - ((k < 0) & ((n & (n - 1)) == 0)).to(tl.int32)
    counts = tl.where(binade == 2, 1, tl.where(binade == 3, 2, tl.where(binade == 4, 5, 0)))
    counts = tl.where(binade == 5, 11, tl.where(binade == 6, 22, counts))
    return tl.where(k == 0, 0, counts)


@triton.jit
def dsv41_window_encode(bits, TOK: tl.constexpr, DIM_P2: tl.constexpr):
    """(element codes [TOK, DIM_P2], scale bytes [TOK, DIM_P2 // 32]) of the V4.1 window record."""
    NB: tl.constexpr = DIM_P2 // 32
    mag, nan = _magnitude(bits)
    amax = tl.max(tl.reshape(mag, (TOK, NB, 32)), axis=2).to(tl.float32, bitcast=True)
    floor = tl.full(amax.shape, 0x38D1B717, tl.int32).to(tl.float32, bitcast=True)  # float32(1e-4)
    q = tl.math.div_rn(tl.maximum(amax, floor), tl.full(amax.shape, 448.0, tl.float32))
    qbits = q.to(tl.int32, bitcast=True)
    k = (qbits >> 23) - 127
    e = k + ((qbits & 0x7FFFFF) > _swallowed(k)).to(tl.int32)
    codes = e4m3_code(bits, _per_block(e, TOK, NB, 32))
    return tl.where(nan, 0x7F, codes), e + 127


@triton.jit
def _e2m1_round(a):
    """Unsigned E2M1 code of a float |q| (nearest, ties to even, saturating at 6)."""
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    return code + (a > 5.0).to(tl.int32)


@triton.jit
def dsv41_compressed_encode(x, bits, TOK: tl.constexpr, DIM_P2: tl.constexpr):
    """(packed nibble bytes [TOK, DIM_P2 // 2], E4M3 scale bytes [TOK, DIM_P2 // 16]) of the
    V4.1 compressed record."""
    NB: tl.constexpr = DIM_P2 // 16
    mag, nan = _magnitude(bits)
    amax = tl.max(tl.reshape(mag, (TOK, NB, 16)), axis=2).to(tl.float32, bitcast=True)
    nan_b = tl.max(tl.reshape(nan.to(tl.int32), (TOK, NB, 16)), axis=2) > 0
    amax = tl.maximum(amax, 0.01171875)  # 6 * 2^-9: the scale is at least 2^-9
    sixth = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    scale = e4m3_code(sixth.to(tl.int32, bitcast=True), 0)  # > 0: only saturation clamps
    q = tl.math.div_rn(x, _per_block(e4m3_value(scale), TOK, NB, 16))
    nib = _e2m1_round(tl.abs(q)) | (((bits >> 31) & 1) << 3)  # the sign bit: -0.0 gives 0x8
    nib = tl.where(_per_block(nan_b.to(tl.int32), TOK, NB, 16) == 1, 7, nib)
    return _pack_nibbles(nib, TOK, DIM_P2), tl.where(nan_b, 0x7F, scale)


@triton.jit
def _pack_nibbles(nib, TOK: tl.constexpr, DIM_P2: tl.constexpr):
    """Bytes [TOK, DIM_P2 // 2]: element 2i in the low nibble, 2i+1 in the high nibble."""
    low, high = tl.split(tl.reshape(nib, (TOK, DIM_P2 // 2, 2)))
    return low | (high << 4)


@triton.jit
def _unpack_nibbles(packed, TOK: tl.constexpr, DIM_P2: tl.constexpr):
    """Nibbles [TOK, DIM_P2] of packed bytes [TOK, DIM_P2 // 2] (int32)."""
    return tl.reshape(tl.join(packed & 0xF, (packed >> 4) & 0xF), (TOK, DIM_P2))


@triton.jit
def _e2m1_value(nib):
    code = nib & 7
    mag = tl.where(code < 4, code.to(tl.float32) * 0.5, (code - 2).to(tl.float32))
    mag = tl.where(code == 7, 6.0, mag)
    return _with_sign(mag, (nib >> 3) & 1)


@triton.jit
def e4m3_scaled_fp4_decode(packed, scales, TOK: tl.constexpr, DIM_P2: tl.constexpr):
    """float32 [TOK, DIM_P2] from packed nibbles and E4M3 block scales (0x7F -> NaN)."""
    nib = _unpack_nibbles(packed, TOK, DIM_P2)
    return _e2m1_value(nib) * _per_block(e4m3_value(scales), TOK, DIM_P2 // 16, 16)


@triton.jit
def mxfp4_encode(bits, TOK: tl.constexpr, DIM_P2: tl.constexpr):
    """(packed nibble bytes [TOK, DIM_P2 // 2], UE8M0 scale bytes [TOK, DIM_P2 // 32]).

    Elements are rounded on the bits (`e2m1_code`), never through a float multiply, so a
    flush-to-zero mode cannot change a code.
    """
    scale, e, zero, nan = _mx_scales(bits, 2, TOK, DIM_P2)  # 2 = emax of E2M1
    nib = tl.where((zero | nan) == 1, 0, e2m1_code(bits, e))
    return _pack_nibbles(nib, TOK, DIM_P2), scale


@triton.jit
def dsv41_index_key_encode(bits, TOK: tl.constexpr, DIM_P2: tl.constexpr):
    """(packed nibble bytes [TOK, DIM_P2 // 2], UE8M0 scale bytes [TOK, DIM_P2 // 32]) of the
    V4.1 index key: 2^e is max(amax, 6 * 2^-126) * float32(1/6) rounded up to a power of two."""
    NB: tl.constexpr = DIM_P2 // 32
    mag, nan = _magnitude(bits)
    amax = tl.max(tl.reshape(mag, (TOK, NB, 32)), axis=2).to(tl.float32, bitcast=True)
    nan_b = tl.max(tl.reshape(nan.to(tl.int32), (TOK, NB, 32)), axis=2) > 0
    floor = tl.full(amax.shape, 0x01C00000, tl.int32).to(tl.float32, bitcast=True)  # 6 * 2^-126
    sixth = tl.full(amax.shape, 0x3E2AAAAB, tl.int32).to(tl.float32, bitcast=True)  # float32(1/6)
    qbits = (tl.maximum(amax, floor) * sixth).to(tl.int32, bitcast=True)
    e = (qbits >> 23) - 127 + ((qbits & 0x7FFFFF) != 0).to(tl.int32)
    nib = e2m1_code(bits, _per_block(e, TOK, NB, 32))
    nib = tl.where(_per_block(nan_b.to(tl.int32), TOK, NB, 32) == 1, 0, nib)
    return _pack_nibbles(nib, TOK, DIM_P2), tl.where(nan_b, 0xFF, e + 127)


@triton.jit
def mxfp4_decode(packed, scales, TOK: tl.constexpr, DIM_P2: tl.constexpr):
    """float32 [TOK, DIM_P2] from packed nibbles and UE8M0 block scales (0xFF -> NaN)."""
    nib = _unpack_nibbles(packed, TOK, DIM_P2)
    return _e2m1_value(nib) * _per_block(_ue8m0_value(scales), TOK, DIM_P2 // 32, 32)


@triton.jit
def bf16_encode(bits):
    """bfloat16 bits (0..65535) of float32 bits: RNE; any NaN -> 0xFFFF, which is what
    torch's CPU cast (the reference) writes for NaN of either sign."""
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(nan, 0xFFFF, rounded)


# ---------------------------------------------------------------- row tiles in memory

OCP_MXFP8, DSV41_NVFP4, BF16, FP32, RAW, OCP_MXFP4, DSV41_MXFP8, DSV41_MXFP4 = 0, 1, 2, 3, 4, 5, 6, 7
"""Format codes of the row kernels; BF16 / FP32 / RAW rows go through typed views."""


@triton.jit
def _store_packed(dst, packed, scales, ok, BLOCK: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr):
    """Write a packed-nibble row (DSV41_NVFP4, OCP_MXFP4): DIM // 2 nibble bytes, then one scale byte per block."""
    h = tl.arange(0, DIM_P2 // 2)[None, :]
    nb = tl.arange(0, DIM_P2 // BLOCK)[None, :]
    tl.store(dst + h, packed.to(tl.uint8), mask=ok & (h < DIM // 2))
    tl.store(dst + DIM // 2 + nb, scales.to(tl.uint8), mask=ok & (nb < DIM // BLOCK))


@triton.jit
def _load_packed(src, ok, BLOCK: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr):
    """(nibble bytes, scale bytes) of a packed-nibble row, as int32; 0 where not ok."""
    h = tl.arange(0, DIM_P2 // 2)[None, :]
    nb = tl.arange(0, DIM_P2 // BLOCK)[None, :]
    packed = tl.load(src + h, mask=ok & (h < DIM // 2), other=0).to(tl.int32)
    scales = tl.load(src + DIM // 2 + nb, mask=ok & (nb < DIM // BLOCK), other=0).to(tl.int32)
    return packed, scales


@triton.jit
def store_rows(dst, x, ok, FMT: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr, TOK: tl.constexpr):
    """Encode float32 x [TOK, DIM_P2] into rows starting at pointers dst [TOK, 1] where ok [TOK, 1].

    The block formats write bytes (dst is uint8); BF16 / FP32 write 16- / 32-bit units
    (dst is an int16 / int32 view of the cache bytes).
    """
    d = tl.arange(0, DIM_P2)[None, :]
    bits = x.to(tl.int32, bitcast=True)
    if FMT == 0 or FMT == 6:
        if FMT == 0:
            codes, scales = mxfp8_encode(bits, TOK, DIM_P2)
        else:
            codes, scales = dsv41_window_encode(bits, TOK, DIM_P2)
        nb = tl.arange(0, DIM_P2 // 32)[None, :]
        tl.store(dst + d, codes.to(tl.uint8), mask=ok & (d < DIM))
        tl.store(dst + DIM + nb, scales.to(tl.uint8), mask=ok & (nb < DIM // 32))
    elif FMT == 1:
        packed, scales = dsv41_compressed_encode(x, bits, TOK, DIM_P2)
        _store_packed(dst, packed, scales, ok, 16, DIM, DIM_P2)
    elif FMT == 5 or FMT == 7:
        if FMT == 5:
            packed, scales = mxfp4_encode(bits, TOK, DIM_P2)
        else:
            packed, scales = dsv41_index_key_encode(bits, TOK, DIM_P2)
        _store_packed(dst, packed, scales, ok, 32, DIM, DIM_P2)
    elif FMT == 2:
        tl.store(dst + d, bf16_encode(bits).to(tl.int16), mask=ok & (d < DIM))
    else:
        tl.store(dst + d, bits, mask=ok & (d < DIM))


@triton.jit
def load_rows(src, ok, FMT: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr, TOK: tl.constexpr):
    """Decode rows starting at pointers src [TOK, 1] into float32 [TOK, DIM_P2] (0 where not ok)."""
    d = tl.arange(0, DIM_P2)[None, :]
    if FMT == 0 or FMT == 6:
        nb = tl.arange(0, DIM_P2 // 32)[None, :]
        codes = tl.load(src + d, mask=ok & (d < DIM), other=0).to(tl.int32)
        scales = tl.load(src + DIM + nb, mask=ok & (nb < DIM // 32), other=0).to(tl.int32)
        out = mxfp8_decode(codes, scales, TOK, DIM_P2)
    elif FMT == 1:
        packed, scales = _load_packed(src, ok, 16, DIM, DIM_P2)
        out = e4m3_scaled_fp4_decode(packed, scales, TOK, DIM_P2)
    elif FMT == 5 or FMT == 7:
        packed, scales = _load_packed(src, ok, 32, DIM, DIM_P2)
        out = mxfp4_decode(packed, scales, TOK, DIM_P2)
    elif FMT == 2:
        units = tl.load(src + d, mask=ok & (d < DIM), other=0).to(tl.int32) & 0xFFFF
        out = (units << 16).to(tl.float32, bitcast=True)
    else:
        out = tl.load(src + d, mask=ok & (d < DIM), other=0).to(tl.float32, bitcast=True)
    return out


@triton.jit
def round_trip_rows(x, FMT: tl.constexpr, DIM_P2: tl.constexpr, TOK: tl.constexpr):
    """decode(encode(x)) in registers: what reading these rows back from a cache gives."""
    bits = x.to(tl.int32, bitcast=True)
    if FMT == 0:
        codes, scales = mxfp8_encode(bits, TOK, DIM_P2)
        out = mxfp8_decode(codes, scales, TOK, DIM_P2)
    elif FMT == 6:
        codes, scales = dsv41_window_encode(bits, TOK, DIM_P2)
        out = mxfp8_decode(codes, scales, TOK, DIM_P2)
    elif FMT == 1:
        packed, scales = dsv41_compressed_encode(x, bits, TOK, DIM_P2)
        out = e4m3_scaled_fp4_decode(packed, scales, TOK, DIM_P2)
    elif FMT == 5:
        packed, scales = mxfp4_encode(bits, TOK, DIM_P2)
        out = mxfp4_decode(packed, scales, TOK, DIM_P2)
    elif FMT == 7:
        packed, scales = dsv41_index_key_encode(bits, TOK, DIM_P2)
        out = mxfp4_decode(packed, scales, TOK, DIM_P2)
    elif FMT == 2:
        out = (bf16_encode(bits) << 16).to(tl.float32, bitcast=True)
    else:
        out = x
    return out
