"""Exact bytes and exact decoded floats of the block formats, and their error bounds.

Every expected byte and float below is written out by hand from the layouts in the
docstring of b12x_toolchain.runtime.formats.codecs (the derivation is in the comment next to it), never
produced by the encoder. Decoded floats are compared bit for bit, so the sign of a zero
counts; NaN compares equal to NaN.

Notation: E4M3 byte = sign | 4-bit exponent (bias 7) | 3-bit mantissa, subnormals
n * 2^-9 for n = 1..7, 0x7E = 1.75 * 2^8 = 448. E2M1 nibble = sign 0x8 | code, codes
0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; byte i of a packed row = nibble 2i | nibble 2i+1 << 4.
MX scales: amax = m * 2^k with m in [1, 2) gives e = k - emax (emax 8 for E4M3, 2 for
E2M1), clamped to [-127, 127], scale byte e + 127.
"""


import pytest
import torch

from b12x_toolchain.runtime.formats import codecs as formats
from b12x_toolchain.runtime.formats import minifloat
from b12x_toolchain.runtime.formats.codecs import FORMATS

MX8 = FORMATS["ocp_mxfp8"]
NV4 = FORMATS["dsv41_nvfp4"]
MX4 = FORMATS["ocp_mxfp4"]
NAN = float("nan")
INF = float("inf")


def _row(values, dim):
    """float32 [dim]: the given leading values, zeros after."""
    x = torch.zeros(dim)
    x[: len(values)] = torch.tensor(values, dtype=torch.float32)
    return x


def _check(fmt, x, want_bytes, want_floats):
    """encode(x) has exactly want_bytes and decoding them gives exactly want_floats."""
    dim = x.shape[-1]
    got = fmt.encode(x)
    assert got.reshape(-1).tolist() == want_bytes
    dec = fmt.decode(torch.tensor(want_bytes, dtype=torch.uint8), dim)
    want = torch.tensor(want_floats + [0.0] * (dim - len(want_floats)), dtype=torch.float32)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(dec), nan)
    assert torch.equal(dec.view(torch.int32)[~nan], want.view(torch.int32)[~nan]), dec.tolist()


# ---------------------------------------------------------------------------- row sizes


@pytest.mark.parametrize(
    "name,dim,nbytes",
    [
        ("ocp_mxfp8", 512, 528),  # 512 elements + 16 scales
        ("dsv41_mxfp8", 512, 528),  # the V4.1 window record
        ("dsv41_nvfp4", 512, 288),  # 256 nibble bytes + 32 scales: the V4.1 compressed record
        ("ocp_mxfp4", 128, 68),  # 64 nibble bytes + 4 scales: the indexer keys
        ("ocp_mxfp4", 512, 272),  # 256 + 16
        ("ocp_mxfp4", 32, 17),
    ],
)
def test_row_bytes(name, dim, nbytes):
    assert FORMATS[name].row_bytes(dim) == nbytes
    assert FORMATS[name].encode(torch.zeros(3, dim)).shape == (3, nbytes)
    assert FORMATS[name].decode(torch.zeros(3, nbytes, dtype=torch.uint8), dim).shape == (3, dim)


@pytest.mark.parametrize("dim", [16, 48, 100, 0])
def test_ocp_mxfp4_rejects_dims_that_are_not_whole_blocks(dim):
    with pytest.raises(ValueError, match=rf"ocp_mxfp4: dim {dim}\b.*32"):
        MX4.row_bytes(dim)


def test_ocp_mxfp4_is_registered():
    assert formats.get_format("ocp_mxfp4") is MX4
    assert (MX4.name, MX4.block, MX4.block_bytes) == ("ocp_mxfp4", 32, 17)


# ---------------------------------------------------------------------------- ocp_mxfp8


def test_ocp_mxfp8_zeros_and_negative_zeros():
    # amax == 0 -> scale 0x00, elements 0x00, whatever the sign of the zeros; decodes to +0.0.
    _check(MX8, torch.zeros(32), [0] * 33, [0.0] * 32)
    _check(MX8, torch.full((64,), -0.0), [0] * 66, [0.0] * 64)


def test_ocp_mxfp8_format_maxima():
    # 448 = 1.75 * 2^8 -> e = 0, byte 127 = 0x7F; +-448 -> 0x7E / 0xFE.
    _check(MX8, _row([448.0, -448.0], 32), [0x7E, 0xFE] + [0] * 30 + [0x7F], [448.0, -448.0])
    # 0.4375 = 1.75 * 2^-2 -> e = -10, byte 117 = 0x75; x * 2^10 = +-448 again.
    _check(MX8, _row([0.4375, -0.4375], 32), [0x7E, 0xFE] + [0] * 30 + [0x75], [0.4375, -0.4375])


def test_ocp_mxfp8_subnormal_elements():
    # amax = 1 -> e = -8, byte 119 = 0x77; v = x * 2^8. E4M3 normals start at 2^-6
    # (x = 2^-14); below, the grid is n * 2^-9 (x = n * 2^-17).
    #   1          -> v = 2^8: exponent 15 -> 0x78
    #   2^-14      -> v = 2^-6, smallest normal: exponent 1 -> 0x08
    #   7 * 2^-17  -> v = 7 * 2^-9, largest subnormal -> 0x07
    #   2^-17      -> v = 2^-9, smallest subnormal -> 0x01
    #   5 * 2^-18  -> v = 2.5 * 2^-9: tie of 2 and 3 -> even 2 -> 0x02, decodes 2^-16
    #   2^-18      -> v = 0.5 * 2^-9: tie of 0 and 1 -> even 0 -> 0x00, decodes +0.0
    #   3 * 2^-19  -> v = 0.75 * 2^-9 -> 1 -> 0x01, decodes 2^-17
    #   -3 * 2^-17 -> v = -3 * 2^-9 -> 0x83
    #   15 * 2^-18 -> v = 7.5 * 2^-9: tie of 7 (0x07) and 8 * 2^-9 = 2^-6 (0x08) -> 0x08, decodes 2^-14
    p = 2.0**-17
    x = _row([1.0, 2.0**-14, 7 * p, p, 2.5 * p, 0.5 * p, 0.75 * p, -3 * p, 7.5 * p], 32)
    _check(
        MX8, x,
        [0x78, 0x08, 0x07, 0x01, 0x02, 0x00, 0x01, 0x83, 0x08] + [0] * 23 + [0x77],
        [1.0, 2.0**-14, 7 * p, p, 2 * p, 0.0, p, -3 * p, 8 * p],
    )


def test_ocp_mxfp8_float32_subnormal_block_uses_the_clamped_scale():
    # amax = 2^-130 -> e = -130 - 8 = -138, clamped to -127 -> byte 0x00; v = x * 2^127:
    #   2^-130 -> 2^-3: exponent -3 + 7 = 4 -> 0x20;  2^-136 -> 2^-9 -> 0x01;
    #   -2^-149 (smallest float32 subnormal) -> -2^-22 rounds to -0 -> 0x80.
    # Decode: 2^-3 * 2^-127 = 2^-130 and 2^-9 * 2^-127 = 2^-136, both exact float32 subnormals.
    _check(
        MX8, _row([2.0**-130, 2.0**-136, -(2.0**-149)], 32),
        [0x20, 0x01, 0x80] + [0] * 29 + [0x00],
        [2.0**-130, 2.0**-136, -0.0],
    )


def test_ocp_mxfp8_nan_block():
    # Block 0 holds a NaN -> 32 x 0x7F and scale 0xFF, decodes to NaN throughout.
    # Block 1 = [-1, 0...]: e = -8 -> 0x77; -1 * 2^8 = -256 -> 0x80 | 0x78 = 0xF8.
    for nan in (NAN, -NAN):
        x = _row([1.0, nan], 64)
        x[32] = -1.0
        _check(MX8, x, [0x7F] * 32 + [0xF8] + [0] * 31 + [0xFF, 0x77], [NAN] * 32 + [-1.0])


def test_ocp_mxfp8_block_maximum_sets_the_scale():
    # amax = 3 = 1.5 * 2^1 -> e = 1 - 8 = -7, byte 120 = 0x78; v = x * 2^7:
    #   3    -> 384 = 1.5 * 2^8: exponent 15, mantissa 4 -> 0x7C
    #   0.1  -> 12.8 = 1.6 * 2^3: mantissa 4.8 -> 5 -> exponent 10 -> 0x55, decodes 13 * 2^-7
    #   -1.5 -> -192 = -1.5 * 2^7: exponent 14, mantissa 4 -> 0xF4
    #   2.9  -> 371.2 = 1.45 * 2^8: mantissa 3.6 -> 4 -> 0x7C, decodes 3
    _check(
        MX8, _row([3.0, 0.1, -1.5, 2.9], 32),
        [0x7C, 0x55, 0xF4, 0x7C] + [0] * 28 + [0x78],
        [3.0, 13 * 2.0**-7, -1.5, 3.0],
    )


def test_ocp_mxfp8_ties_to_even():
    # amax = 1.1875 -> e = -8, byte 0x77; v = x * 2^8. Steps: 32 in [256, 512), 16 in [128, 256).
    #   1.0625   -> 272: tie of 256 (m 0) and 288 (m 1) -> 256 -> 0x78, decodes 1
    #   1.1875   -> 304: tie of 288 (m 1) and 320 (m 2) -> 320 -> 0x7A, decodes 1.25
    #   0.53125  -> 136: tie of 128 (m 0) and 144 (m 1) -> 128 -> 0x70, decodes 0.5
    #   -0.59375 -> -152: tie of 144 (m 1) and 160 (m 2) -> 160 -> 0xF2, decodes -0.625
    _check(
        MX8, _row([1.0625, 1.1875, 0.53125, -0.59375], 32),
        [0x78, 0x7A, 0x70, 0xF2] + [0] * 28 + [0x77],
        [1.0, 1.25, 0.5, -0.625],
    )


def test_ocp_mxfp8_negative_zero_in_a_live_block():
    # amax = 1 -> 0x77. -0.0 -> 0x80 (the cast keeps the sign); -2^-20 -> v = -2^-12 rounds
    # to -0 -> 0x80. Both decode to -0.0.
    _check(MX8, _row([1.0, -0.0, -(2.0**-20)], 32), [0x78, 0x80, 0x80] + [0] * 29 + [0x77], [1.0, -0.0, -0.0])


def test_ocp_mxfp8_infinities():
    # +-inf count as float32 max = (2 - 2^-23) * 2^127 -> e = 127 - 8 = 119, byte 246 = 0xF6;
    # they saturate to +-448 (0x7E / 0xFE) and decode to +-448 * 2^119 = +-1.75 * 2^127.
    _check(MX8, _row([INF, -INF], 32), [0x7E, 0xFE] + [0] * 30 + [0xF6], [1.75 * 2.0**127, -1.75 * 2.0**127])


# ---------------------------------------------------------------------------- dsv41_nvfp4 (the V4.1 compressed record)


def test_dsv41_nvfp4_zeros_and_negative_zeros():
    # amax 0 is raised to 6 * 2^-9: s = 2^-9 (0x01). The sign bit is signbit(x): -0.0 -> 0x8.
    _check(NV4, torch.zeros(16), [0] * 8 + [0x01], [0.0] * 16)
    _check(NV4, torch.full((32,), -0.0), [0x88] * 16 + [0x01, 0x01], [-0.0] * 32)


def test_dsv41_nvfp4_format_maxima():
    # 2688 = 6 * 448: s = E4M3(448) = 0x7E, q = +-6 -> nibbles 0x7, 0xF -> byte 0xF7.
    _check(NV4, _row([2688.0, -2688.0], 16), [0xF7] + [0] * 7 + [0x7E], [2688.0, -2688.0])
    # amax = 6 -> s = 1 = 0x38 (exponent 7); q = x: 6 -> 7, -6 -> 0xF, 3 -> 5, -0.5 -> 0x9.
    _check(NV4, _row([6.0, -6.0, 3.0, -0.5], 16), [0xF7, 0x95] + [0] * 6 + [0x38], [6.0, -6.0, 3.0, -0.5])


def test_dsv41_nvfp4_subnormal_scale_and_elements():
    # amax = 9 * 2^-8 -> amax / 6 = 3 * 2^-9: E4M3 subnormal 3 -> s = 0x03, exact. q = x / s:
    #   9 * 2^-8     -> 6 -> 7
    #   -3 * 2^-10   -> -0.5 (the E2M1 subnormal) -> 0x9
    #   0.75 * 2^-9  -> 0.25: tie of 0 and 0.5 -> 0 -> 0x0
    #   3.75 * 2^-9  -> 1.25: tie of 1 (code 2) and 1.5 (code 3) -> 2
    # Decode: 6 s = 18 * 2^-9, -0.5 s = -1.5 * 2^-9, 0, 1 s = 3 * 2^-9.
    p = 2.0**-9
    _check(
        NV4, _row([18 * p, -1.5 * p, 0.75 * p, 3.75 * p], 16),
        [0x97, 0x20] + [0] * 6 + [0x03],
        [18 * p, -1.5 * p, 0.0, 3 * p],
    )


def test_dsv41_nvfp4_small_blocks_keep_the_smallest_scale():
    # amax = 6 * 2^-10 is raised to 6 * 2^-9 -> s = 2^-9 = 0x01 (nothing flushes to zero):
    # q = 6 * 2^-10 / 2^-9 = 3 -> code 5;  -0.001 / 2^-9 = -0.512 -> 0.5 -> 1|8 = 0x9.
    _check(NV4, _row([6 * 2.0**-10, -0.001], 16), [0x95] + [0] * 7 + [0x01], [3 * 2.0**-9, -0.5 * 2.0**-9])
    # amax = 6.5 * 2^-10, raised the same way -> 0x01; q = 3.25 -> 3 (code 5).
    _check(NV4, _row([6.5 * 2.0**-10], 16), [0x05] + [0] * 7 + [0x01], [3 * 2.0**-9])


def test_dsv41_nvfp4_nan_block():
    # Block 0 holds a NaN -> every nibble 0x7 and scale 0x7F (E4M3 NaN): NaN throughout.
    # Block 1 = [-3, 0...]: s = E4M3(0.5) = exponent 6 -> 0x30; q = -6 -> 0xF.
    for nan in (NAN, -NAN):
        x = _row([1.0, nan], 32)
        x[16] = -3.0
        _check(NV4, x, [0x77] * 8 + [0x0F] + [0] * 7 + [0x7F, 0x30], [NAN] * 16 + [-3.0])


def test_dsv41_nvfp4_block_maximum_sets_the_scale():
    # amax = 7 -> 7 / 6 = 1.1667: mantissa 1.33 -> 1 -> s = 1.125 = 0x39. q = x / 1.125:
    #   7 -> 6.22 saturates -> 7;  1 -> 0.889 (>= 0.75) -> 2;  -2 -> -1.78 (>= 1.75) -> 0xC
    #   4 -> 3.56 (>= 3.5) -> 6;  0.5 -> 0.444 -> 1
    # Decode: 6.75, 1.125, -2.25, 4.5, 0.5625.
    _check(
        NV4, _row([7.0, 1.0, -2.0, 4.0, 0.5], 16),
        [0x27, 0x6C, 0x01] + [0] * 5 + [0x39],
        [6.75, 1.125, -2.25, 4.5, 0.5625],
    )


def test_dsv41_nvfp4_ties_to_even():
    # Elements: amax = 12 -> s = E4M3(2) = exponent 8 -> 0x40; q = x / 2 lands on every
    # E2M1 midpoint: 0.25 -> 0, 0.75 -> 2, 1.25 -> 2, 1.75 -> 4, 2.5 -> 4, 3.5 -> 6, 5 -> 6.
    # x:     12  0.5  1.5  2.5  3.5  5  7  10  -1.5  -10  -0.5
    # code:   7   0    2    2    4   4  6   6   0xA  0xE   0x8 (negative rounding to zero)
    _check(
        NV4, _row([12.0, 0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0, -1.5, -10.0, -0.5], 16),
        [0x07, 0x22, 0x44, 0x66, 0xEA, 0x08, 0x00, 0x00, 0x40],
        [12.0, 0.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, -2.0, -8.0, -0.0],
    )
    # The scale: amax / 6 = 1.0625 ties 1 (m 0) and 1.125 (m 1) -> 1 = 0x38; 6.375 saturates
    # to 6. amax / 6 = 1.1875 ties 1.125 (m 1) and 1.25 (m 2) -> 1.25 = 0x3A; 7.125 / 1.25 = 5.7
    # -> 6 -> 7.5.
    x = _row([6.375], 32)
    x[16] = 7.125
    _check(NV4, x, [0x07] + [0] * 7 + [0x07] + [0] * 7 + [0x38, 0x3A], [6.0] + [0.0] * 15 + [7.5])


def test_dsv41_nvfp4_negative_zero_in_a_live_block():
    # The sign bit is signbit(x): -0.0 -> 0x8 and decodes -0.0; -0.2 -> q = -0.2 rounds to
    # zero with the sign -> 0x8, decodes -0.0. amax = 6 -> s = 0x38.
    _check(NV4, _row([6.0, -0.0, -0.2], 16), [0x87, 0x08] + [0] * 6 + [0x38], [6.0, -0.0, -0.0])


# ---------------------------------------------------------------------------- ocp_mxfp4


def test_ocp_mxfp4_zeros_and_negative_zeros():
    _check(MX4, torch.zeros(32), [0] * 17, [0.0] * 32)
    # A 128-dim indexer row of -0.0: four zero blocks.
    _check(MX4, torch.full((128,), -0.0), [0] * 68, [0.0] * 128)


def test_ocp_mxfp4_format_maxima_and_saturation():
    # 6 = 1.5 * 2^2 -> e = 0, byte 127 = 0x7F; +-6 -> 0x7, 0xF -> byte 0xF7.
    _check(MX4, _row([6.0, -6.0], 32), [0xF7] + [0] * 15 + [0x7F], [6.0, -6.0])
    # amax = 7.9 -> e = 0 still; 7.9 and -7 saturate to +-6 (0x7 / 0xF); 1 -> code 2.
    _check(MX4, _row([7.9, -7.0, 1.0], 32), [0xF7, 0x02] + [0] * 14 + [0x7F], [6.0, -6.0, 1.0])
    # +-inf count as float32 max -> e = 127 - 2 = 125, byte 252 = 0xFC, saturate to +-6;
    # 1e38 * 2^-125 = 2.35 (< 2.5) -> 2 (code 4). Decode: +-6 * 2^125 = +-1.5 * 2^127, 2^126.
    _check(
        MX4, _row([INF, -INF, 1e38], 32),
        [0xF7, 0x04] + [0] * 14 + [0xFC],
        [1.5 * 2.0**127, -1.5 * 2.0**127, 2.0**126],
    )


def test_ocp_mxfp4_subnormal_elements():
    # amax = 4 -> e = 0, byte 0x7F; q = x. Below the smallest E2M1 normal (1) the only
    # nonzero value is the subnormal 0.5:
    #   4 -> 6;  0.5 -> 1;  -0.5 -> 0x9;  0.25 ties 0 and 0.5 -> 0;  0.75 ties 0.5 (code 1)
    #   and 1 (code 2) -> 2;  0.3 -> 1;  0.2 -> 0;  -0.2 -> 0x8 (negative rounding to zero)
    # bytes: (6, 1) = 0x16, (9, 0) = 0x09, (2, 1) = 0x12, (0, 8) = 0x80
    _check(
        MX4, _row([4.0, 0.5, -0.5, 0.25, 0.75, 0.3, 0.2, -0.2], 32),
        [0x16, 0x09, 0x12, 0x80] + [0] * 12 + [0x7F],
        [4.0, 0.5, -0.5, 0.0, 1.0, 0.5, 0.0, -0.0],
    )


def test_ocp_mxfp4_float32_subnormal_block_uses_the_clamped_scale():
    # amax = 2^-127 (a float32 subnormal) -> e = -129, clamped to -127 -> byte 0x00; q = x * 2^127:
    #   2^-127 -> 1 (code 2);  3 * 2^-129 -> 0.75 ties -> code 2;  2^-128 -> 0.5 (code 1);
    #   -2^-149 -> -2^-22 -> 0x8. bytes: (2, 2) = 0x22, (1, 8) = 0x81.
    # Decode: 1 * 2^-127, 1 * 2^-127, 0.5 * 2^-127 = 2^-128, -0.0 (all exact float32).
    _check(
        MX4, _row([2.0**-127, 3 * 2.0**-129, 2.0**-128, -(2.0**-149)], 32),
        [0x22, 0x81] + [0] * 14 + [0x00],
        [2.0**-127, 2.0**-127, 2.0**-128, -0.0],
    )


def test_ocp_mxfp4_nan_block():
    # Block 0 holds a NaN -> nibbles 0 and scale 0xFF: NaN throughout. Block 1 = [-1.5, 0...]:
    # 1.5 = 1.5 * 2^0 -> e = -2, byte 125 = 0x7D; q = -6 -> 0xF. Nibbles of both blocks
    # come first (16 + 16 bytes), then the two scales.
    for nan in (NAN, -NAN):
        x = _row([1.0, nan], 64)
        x[32] = -1.5
        _check(MX4, x, [0] * 16 + [0x0F] + [0] * 15 + [0xFF, 0x7D], [NAN] * 32 + [-1.5])


def test_ocp_mxfp4_block_maximum_sets_the_scale():
    # amax = 3 = 1.5 * 2^1 -> e = 1 - 2 = -1, byte 126 = 0x7E; q = x * 2:
    #   3 -> 6 -> 7;  -1 -> -2 -> 0xC;  0.7 -> 1.4 (> 1.25) -> 3 (1.5);  1.3 -> 2.6 (> 2.5) -> 5 (3)
    #   0.1 -> 0.2 -> 0.  bytes: (7, C) = 0xC7, (3, 5) = 0x53. Decode: q-value / 2.
    _check(
        MX4, _row([3.0, -1.0, 0.7, 1.3, 0.1], 32),
        [0xC7, 0x53] + [0] * 14 + [0x7E],
        [3.0, -1.0, 0.75, 1.5, 0.0],
    )


def test_ocp_mxfp4_ties_to_even():
    # amax = 12 = 1.5 * 2^3 -> e = 1, byte 128 = 0x80; q = x / 2 lands on every midpoint
    # (same codes as the nvfp4 case, whose scale is also 2):
    # x:     12  0.5  1.5  2.5  3.5  5  7  10  -1.5  -10  -0.5
    # code:   7   0    2    2    4   4  6   6   0xA  0xE   0x8
    _check(
        MX4, _row([12.0, 0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0, -1.5, -10.0, -0.5], 32),
        [0x07, 0x22, 0x44, 0x66, 0xEA, 0x08] + [0] * 10 + [0x80],
        [12.0, 0.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, -2.0, -8.0, -0.0],
    )


def test_ocp_mxfp4_negative_zero_in_a_live_block():
    # As mxfp8 (unlike nvfp4) the sign bit is the input's: -0.0 -> 0x8 and -0.2 -> 0x8, both
    # decode to -0.0. amax = 6 -> 0x7F. bytes: (7, 8) = 0x87, (8, 0) = 0x08.
    _check(MX4, _row([6.0, -0.0, -0.2], 32), [0x87, 0x08] + [0] * 14 + [0x7F], [6.0, -0.0, -0.0])


def test_ocp_mxfp4_decodes_every_nibble():
    # Scale byte 0x7F (2^0): nibble n decodes to the E2M1 table; 0x81 (2^2) scales it by 4;
    # 0xFF makes the whole block NaN whatever its nibbles.
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    packed = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2  # nibbles 0..15 twice
    dec = MX4.decode(torch.tensor(packed + [0x7F], dtype=torch.uint8), 32)
    assert torch.equal(dec.view(torch.int32), torch.tensor(table * 2).view(torch.int32))
    dec = MX4.decode(torch.tensor(packed + [0x81], dtype=torch.uint8), 32)
    assert torch.equal(dec.view(torch.int32), torch.tensor([4 * v for v in table] * 2).view(torch.int32))
    assert MX4.decode(torch.tensor(packed + [0xFF], dtype=torch.uint8), 32).isnan().all()


# ------------------------------------------------------------ the E4M3 clamp is explicit


def _nonsaturating_cast(v):
    """An E4M3 cast that writes NaN (0x7F) for anything beyond 448, as some torch versions
    do; torch 2.13 on the CPU saturates instead, which would hide a missing clamp."""
    codes = v.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(v.abs() > 448, 0x7F, codes).to(torch.uint8)


def test_e4m3_results_do_not_depend_on_the_casts_saturation(monkeypatch):
    assert _nonsaturating_cast(torch.tensor([486.4, 500.0])).tolist() == [0x7F, 0x7F]
    # Patched where _to_e4m3_bytes looks it up (every E4M3 encoder goes through it).
    monkeypatch.setattr(minifloat, "_e4m3_cast", _nonsaturating_cast)
    # mxfp8: amax = 60.8 = 1.9 * 2^5 -> e = -3, byte 124 = 0x7C; v = x * 8: 60.8 -> 486.4 and
    # 57 -> 456 lie above 448 and must clamp to +-448 (0x7E / 0xFE); 56 -> 448 exactly.
    _check(
        MX8, _row([60.8, -60.8, 57.0, 56.0], 32),
        [0x7E, 0xFE, 0x7E, 0x7E] + [0] * 28 + [0x7C],
        [56.0, -56.0, 56.0, 56.0],
    )
    # nvfp4: amax = 3000 -> amax / 6 = 500 must clamp to 448 = 0x7E; q = 3000 / 448 = 6.7
    # saturates -> 7; -100 / 448 = -0.22 -> 0x8.
    _check(NV4, _row([3000.0, -100.0], 16), [0x87] + [0] * 7 + [0x7E], [2688.0, -0.0])
    # dsv41_mxfp8, one ulp above 7 (see test_window_record_follows_float32_log2...): e = -6 and
    # 448.00003 must clamp to 448 (0x7E).
    _check(FORMATS["dsv41_mxfp8"], _row([7.0 + 2.0**-21], 32), [0x7E] + [0] * 31 + [0x79], [7.0])


# ---------------------------------------------------------------------------- error bounds


def _data(kind, rows, dim, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "binades":
        # Magnitudes 2^-40 .. 2^40 in every block: most elements are far below their
        # block's maximum, so the subnormal and flush-to-zero paths get as much use as
        # the normal one.
        mag = torch.exp2(torch.randint(-40, 41, (rows, dim), generator=g).float())
        return mag * (1 + torch.rand(rows, dim, generator=g)) * torch.randn(rows, dim, generator=g).sign()
    scale = {"1e-3": 1e-3, "1": 1.0, "1e3": 1e3, "tiny": 2.0**-135, "huge": 2.0**100}[kind]
    return torch.randn(rows, dim, generator=g) * scale  # "tiny": float32 subnormals


KINDS = ["1e-3", "1", "1e3", "binades", "tiny", "huge"]


def _mx_e(xb, emax):
    """e = clamp(floor(log2 amax) - emax, -127, 127) per block, from float64 log2."""
    amax = xb.abs().amax(-1, keepdim=True).double()
    return (torch.floor(torch.log2(amax)) - emax).clamp(-127, 127)


@pytest.mark.parametrize("kind", KINDS)
def test_ocp_mxfp8_round_trip_error_bound(kind):
    # Bound. With e as above, v = x * 2^-e is exact (a power-of-two scaling) and |v| < 2^9.
    #  * 2^-6 <= |v| <= 448 (E4M3 normal): 3 mantissa bits, so RNE errs by at most half an
    #    ulp, 2^(floor(log2 |v|) - 4) <= 2^-4 |v|: |x - q(x)| <= 2^-4 |x|.
    #  * |v| < 2^-6 (subnormal): the grid is 2^-9, half a step is 2^-10: |x - q(x)| <= 2^(e-10).
    #  * 448 < |v| < 512: saturates, q(x) = +-448 * 2^e exactly.
    # So everywhere below saturation |x - q(x)| <= 2^-4 |x| + 2^(e-10), the two terms
    # asserted separately where each applies.
    x = _data(kind, 32, 512, seed=KINDS.index(kind))
    dec = MX8.decode(MX8.encode(x), 512)
    xb, db = x.view(32, 16, 32).double(), dec.view(32, 16, 32).double()
    step = torch.exp2(_mx_e(xb, 8)).expand_as(xb)
    v = (xb / step).abs()
    err = (db - xb).abs()
    normal, sub, sat = (v >= 2**-6) & (v <= 448), v < 2**-6, v > 448
    assert (err[normal] <= 2**-4 * xb.abs()[normal]).all()
    assert (err[sub] <= 2**-10 * step[sub]).all()
    assert torch.equal(db[sat], (xb.sign() * 448 * step)[sat])
    assert normal.any()
    if kind == "binades":
        assert sub.float().mean() > 0.5
    if kind == "tiny":
        assert (step == 2.0**-127).all()  # every block takes the clamped scale


@pytest.mark.parametrize("kind", KINDS)
def test_ocp_mxfp4_round_trip_error_bound(kind):
    # Bound. e = clamp(floor(log2 amax) - 2, -127, 127), v = x * 2^-e, |v| < 8.
    #  * 1 <= |v| <= 6 (E2M1 normal): 1 mantissa bit, half an ulp is
    #    2^(floor(log2 |v|) - 2) <= 2^-2 |v|: |x - q(x)| <= 2^-2 |x|.
    #  * |v| < 1 (0 and the subnormal 0.5): half the smallest step 0.5: |x - q(x)| <= 2^(e-2).
    #  * 6 < |v| < 8: saturates, q(x) = +-6 * 2^e exactly (an error below 2^-2 |x| as well).
    x = _data(kind, 32, 512, seed=10 + KINDS.index(kind))
    dec = MX4.decode(MX4.encode(x), 512)
    xb, db = x.view(32, 16, 32).double(), dec.view(32, 16, 32).double()
    step = torch.exp2(_mx_e(xb, 2)).expand_as(xb)
    v = (xb / step).abs()
    err = (db - xb).abs()
    normal, sub, sat = (v >= 1) & (v <= 6), v < 1, v > 6
    assert (err[normal] <= 2**-2 * xb.abs()[normal]).all()
    assert (err[sub] <= 2**-2 * step[sub]).all()
    assert torch.equal(db[sat], (xb.sign() * 6 * step)[sat])
    assert (err[sat] < 2**-2 * xb.abs()[sat]).all()
    if kind == "binades":
        assert normal.any() and sub.float().mean() > 0.5
    elif kind == "tiny":
        # Every block takes the clamped scale 2^-127, and |v| < 2^-4 < 0.25: all flush to
        # zero, within the subnormal bound 2^(e-2) = 2^-129.
        assert (step == 2.0**-127).all() and not normal.any() and (db == 0).all()
    else:
        assert normal.float().mean() > 0.5


@pytest.mark.parametrize("kind", KINDS)
def test_dsv41_nvfp4_round_trip_error_bound(kind):
    # Bound for the V4.1 compressed record. a = max(amax, 6 * 2^-9) / 6 >= 2^-9 is rounded to
    # the E4M3 scale s (clamped to 448), so s >= 2^-9 > 0 in every block.
    #  * Scale: for 2^-6 <= a <= 448, RNE with 3 mantissa bits gives |s - a| <= 2^-4 a; for
    #    a < 2^-6 (subnormal grid 2^-9), |s - a| <= 2^-10; above 448, s = 448.
    #  * Elements: q = x / s rounded to E2M1. For 1 <= |q| <= 6: |x - q(x)| <= 2^-2 |x| (half
    #    an ulp of a 1-bit mantissa); for |q| < 1: |x - q(x)| <= 2^-2 s (half the step 0.5);
    #    for |q| > 6: saturates, q(x) = +-6 s exactly. While s is a normal E4M3 value,
    #    s >= a (1 - 2^-4) bounds |q| <= 6 / (1 - 2^-4) = 6.4, so the saturation error
    #    |x| - 6 s is below 2^-2 |x| too.
    #  * A block with amax < 6 * 2^-10 (a = 2^-9, q < 0.5) decodes to zeros of its sign.
    # x / s is a float32 division: its rounding could at worst put a value within 2^-24
    # (relative) of a midpoint onto it, hence the factor 1 + 2^-20 on the element bounds.
    x = _data(kind, 32, 512, seed=20 + KINDS.index(kind))
    enc = NV4.encode(x)
    dec = NV4.decode(enc, 512)
    xb, db = x.view(32, 32, 16).double(), dec.view(32, 32, 16).double()
    s = enc[:, 256:].contiguous().view(torch.float8_e4m3fn).double().unsqueeze(-1)
    a = xb.abs().amax(-1, keepdim=True).clamp_min(6 * 2**-9) / 6
    assert (s >= 2**-9).all()
    normal_s = (a >= 2**-6) & (a <= 448)
    assert ((s - a).abs()[normal_s] <= 2**-4 * a[normal_s]).all()
    assert ((s - a).abs()[a < 2**-6] <= 2**-10).all()
    assert (s[a > 448] == 448).all()
    s = s.expand_as(xb)
    q = (xb / s).abs()
    err = (db - xb).abs()
    slack = 1 + 2**-20
    normal, sub, sat = (q >= 1) & (q <= 6), q < 1, q > 6
    assert (err[normal] <= 2**-2 * xb.abs()[normal] * slack).all()
    assert (err[sub] <= 2**-2 * s[sub] * slack).all()
    assert torch.equal(db[sat], (xb.sign() * 6 * s)[sat])
    in_range = normal_s.expand_as(xb)
    assert (err[sat & in_range] <= 2**-2 * xb.abs()[sat & in_range]).all()
    if kind in ("1", "binades"):
        assert normal.any()
    if kind == "tiny":
        assert (db == 0).all()  # 2^-135-sized blocks: q < 0.25 everywhere
    if kind == "huge":
        assert sat.float().mean() > 0.99  # s = 448 and nearly everything saturates


# ---------------------------------------------------------------------------- dsv41_mxfp8
# The V4.1 window record: e = ceil(log2(max(amax, 1e-4) / 448)) with float32 log2, scale byte
# e + 127, elements E4M3(clamp(x / 2^e)). E4M3 at exponent 7 is 128 * (1 + m/8) (step 16),
# at exponent 8 is 256 * (1 + m/8) (step 32): byte = sign | (exponent + 7) << 3 | m.

W41 = FORMATS["dsv41_mxfp8"]


def test_window_record_zero_blocks_take_the_1e4_floor():
    # amax 0 -> 1e-4 / 448 = 2.23e-7 = 2^-22.1 -> e = -22, byte 105 = 0x69; -0.0 keeps 0x80.
    _check(W41, _row([0.0, -0.0], 32), [0x00, 0x80] + [0] * 30 + [0x69], [0.0, -0.0])


def test_window_record_takes_the_power_of_two_at_or_above_amax_over_448():
    # amax 448 -> q = 1 -> e = 0 (0x7F): 448 -> 0x7E, -448 -> 0xFE, 1 -> 0x38.
    _check(W41, _row([448.0, -448.0, 1.0], 32), [0x7E, 0xFE, 0x38] + [0] * 29 + [0x7F], [448.0, -448.0, 1.0])
    # amax 449 -> q = 1.0022 -> e = 1 (0x80): 449 / 2 = 224.5 -> 224 = 1.75 * 2^7 -> 0x76, decoding
    # 448 (the OCP rule keeps e = 0 and saturates 449 to 448 with the same value).
    _check(W41, _row([449.0], 32), [0x76] + [0] * 31 + [0x80], [448.0])
    # amax 10 -> q = 0.0223 = 2^-5.49 -> e = -5 (0x7A): 10 * 32 = 320 = 1.25 * 2^8 -> 0x7A;
    # 0.1 * 32 = 3.2 -> 3.25 = 1.625 * 2 -> 0x45, decoding 0.1015625.
    _check(W41, _row([10.0, 0.1], 32), [0x7A, 0x45] + [0] * 30 + [0x7A], [10.0, 0.1015625])


def test_window_record_follows_float32_log2_one_ulp_above_a_power_of_two():
    # amax = 7 + 2^-21 (one float32 ulp above 7): q = amax / 448 rounds to 2^-6 + 2^-29, one
    # ulp above 2^-6. log2 of it is -6 + 1.7e-7, whose nearest float32 is -6 (spacing 4.8e-7
    # there): e = -6 (0x79), and amax * 64 = 448.00003 clamps to 448 (0x7E), decoding 7.
    _check(W41, _row([7.0 + 2.0**-21], 32), [0x7E] + [0] * 31 + [0x79], [7.0])
    # Three ulps above 7 make q two ulps above 2^-6: log2 -6 + 3.4e-7 rounds to -6 + 4.8e-7,
    # so e = -5 (0x7A) and amax * 32 = 224.00002 -> 224 (0x76), also decoding 7.
    _check(W41, _row([7.0 + 3 * 2.0**-21], 32), [0x76] + [0] * 31 + [0x7A], [7.0])


def test_window_record_non_finite_values():
    # +-inf count as float32 max: q = 7.6e35 = 2^119.2 -> e = 120 (0xF7); +-inf -> +-448
    # (0x7E, 0xFE), decoding +-448 * 2^120, beyond float32: +-inf again. 1 * 2^-120 -> 0.
    _check(W41, _row([INF, -INF, 1.0], 32), [0x7E, 0xFE, 0x00] + [0] * 29 + [0xF7], [INF, -INF, 0.0])
    # NaN elements are 0x7F; the rest as without them: amax 2 -> q = 2^-7.8 -> e = -7 (0x78);
    # 1 * 128 = 128 -> 0x70, -2 * 128 = -256 -> 0xF8.
    _check(W41, _row([NAN, 1.0, -2.0], 32), [0x7F, 0x70, 0xF8] + [0] * 29 + [0x78], [NAN, 1.0, -2.0])


def _ue8m0_round_trip(fmt, kind, dim, seed):
    """(x, decoded, 2^e per block, |x| / 2^e) in float64 blocks of 32 of a UE8M0-scaled format."""
    x = _data(kind, 32, dim, seed=seed)
    enc = fmt.encode(x)
    xb, db = x.view(32, dim // 32, 32).double(), fmt.decode(enc, dim).view(32, dim // 32, 32).double()
    step = torch.exp2(enc[:, -(dim // 32):].double() - 127).unsqueeze(-1)
    return xb, db, step, (xb / step).abs()


@pytest.mark.parametrize("kind", KINDS)
def test_window_record_round_trip_error_bound(kind):
    # Bound. e is the least exponent with 448 * 2^e >= m = max(amax, 1e-4), bar the few-ulp
    # blocks where float32 log2 keeps it one lower; so m <= 448 * 2^e * (1 + 2^-21) and,
    # unless m is a power of two times 448, 448 * 2^(e-1) < m.
    #  * v = x / 2^e: normal E4M3 (|v| >= 2^-6) keeps 3 mantissa bits, |err| <= 2^-4 |x|;
    #    subnormal, the step is 2^-9: |err| <= 2^-10 * 2^e.
    #  * |v| <= 448 (1 + 2^-21): nothing saturates by more than 2^-21 |x|.
    xb, db, step, v = _ue8m0_round_trip(W41, kind, 512, seed=40 + KINDS.index(kind))
    m = xb.abs().amax(-1, keepdim=True).clamp_min(float(torch.tensor(1e-4)))
    assert (m <= 448 * step * (1 + 2**-21)).all()
    assert (m >= 224 * step).all()  # e is never more than needed
    err = (db - xb).abs()
    normal, sub = (v >= 2**-6) & (v <= 448), v < 2**-6
    assert (err[normal] <= 2**-4 * xb.abs()[normal]).all()
    assert (err[sub] <= (2**-10 * step).expand_as(v)[sub]).all()
    assert (err[v > 448] <= 2**-21 * xb.abs()[v > 448]).all()
    if kind == "1":
        assert normal.float().mean() > 0.9


# ---------------------------------------------------------------------------- dsv41_mxfp4
# The V4.1 index key: q = max(amax, 6 * 2^-126) * float32(1/6), rounded up to a power of
# two 2^e on the bits (scale byte e + 127); elements E2M1(x * 2^-e), the sign bit of x.

K41 = FORMATS["dsv41_mxfp4"]


def test_index_key_bytes():
    # amax 6: 6 * float32(1/6) = 1.0000000298 rounds to 1.0 -> e = 0 (0x7F). 6 -> 7, -3 -> 0xD,
    # 0.25 ties 0 and 0.5 -> 0; 0.75 ties 0.5 and 1 -> code 2.
    _check(K41, _row([6.0, -3.0, 0.25, 0.75], 32), [0xD7, 0x20] + [0] * 14 + [0x7F], [6.0, -3.0, 0.0, 1.0])
    # amax 7: q = 1.1667 -> 2 -> e = 1 (0x80); 7 / 2 = 3.5 ties 3 and 4 -> 4 (code 6), decoding
    # 8 (ocp_mxfp4 keeps e = 0 and saturates 7 to 6).
    _check(K41, _row([7.0], 32), [0x06] + [0] * 15 + [0x80], [8.0])
    # A zero block: q = 6 * 2^-126 * float32(1/6) rounds to 2^-126 -> e = -126 (0x01); -0.0 -> 0x8.
    _check(K41, _row([0.0, -0.0], 32), [0x80] + [0] * 15 + [0x01], [0.0, -0.0])


@pytest.mark.parametrize("kind", KINDS)
def test_index_key_round_trip_error_bound(kind):
    # Bound. 2^e >= amax / 6 (up to the float32 rounding of the product, < 2^-23 relative), so
    # |v| = |x| / 2^e <= 6 (1 + 2^-22) and nothing saturates by more than that; E2M1 moves a
    # |v| >= 1 by at most 2^-2 of itself and a smaller one by at most 2^-2 * 2^e.
    xb, db, step, v = _ue8m0_round_trip(K41, kind, 128, seed=60 + KINDS.index(kind))
    assert (v <= 6 * (1 + 2**-22)).all()
    err = (db - xb).abs()
    assert (err[v >= 1] <= 2**-2 * xb.abs()[v >= 1] * (1 + 2**-20)).all()
    assert (err[v < 1] <= (2**-2 * step).expand_as(v)[v < 1]).all()
