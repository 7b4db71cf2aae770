"""DeepSeek weight formats: the combinations a format takes, its stored tensors, bytes and JSON;
decoding is exact, the quantizers round as DeepSeek's do.

Expected values are computed here in float64 from the formats' definitions (sign,
exponent and mantissa fields; 2^(byte - 127) scales), never by the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from b12x_toolchain.runtime.formats.weight_formats import (
    FP8_BLOCKS,
    FP32,
    WeightFormat,
    act_quant_e4m3,
    decode_fp4,
    decode_fp8_block,
    quantize_fp4,
    quantize_fp8_block,
    ue8m0_from,
)

NAN = float("nan")
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 7
    if exponent == 0xF and mantissa == 7:
        return NAN
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def _e2m1_value(nibble: int) -> float:
    return (-1.0 if nibble & 8 else 1.0) * E2M1_MAGNITUDES[nibble & 7]


def _ue8m0_value(byte: int) -> float:
    return NAN if byte == 255 else 2.0 ** (byte - 127)


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equal float32, any NaN equal to any NaN."""
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(
        torch.where(nan, 0, got.view(torch.int32)), torch.where(nan, 0, want.view(torch.int32)))


def _grid(scale: torch.Tensor, block, shape) -> torch.Tensor:
    """float64 per-element scales of an FP8 weight of `shape` (the scale grid expanded, cropped)."""
    values = scale.view(torch.uint8).double().apply_(_ue8m0_value) if scale.dtype == torch.float8_e8m0fnu \
        else scale.double()
    return values.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


def _e8m0(bytes_: list[int]) -> torch.Tensor:
    return torch.tensor(bytes_, dtype=torch.uint8).view(torch.float8_e8m0fnu)


# ---------------------------------------------------------------- UE8M0 scales


def test_ue8m0_from_takes_every_encoding_a_checkpoint_uses():
    raw = torch.tensor([[0, 1, 126, 127], [128, 200, 254, 255]], dtype=torch.uint8)
    canonical = ue8m0_from(raw)
    assert canonical.dtype == torch.float8_e8m0fnu and torch.equal(canonical.view(torch.uint8), raw)
    assert ue8m0_from(canonical) is canonical
    powers = torch.tensor([2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127], dtype=torch.float32)
    assert ue8m0_from(powers).view(torch.uint8).tolist() == [0, 1, 126, 127, 128, 254]


@pytest.mark.parametrize("value", [3.0, 0.0, -2.0, 2.0**-128, float("inf"), NAN, 1.5])
def test_ue8m0_from_refuses_a_float32_that_is_not_a_power_of_two(value):
    scale = torch.tensor([[1.0, 2.0], [4.0, value]], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"float32 scale .* at index \(1, 1\) is not a power of two"):
        ue8m0_from(scale)


def test_ue8m0_from_refuses_other_dtypes():
    with pytest.raises(ValueError, match="not torch.int32"):
        ue8m0_from(torch.ones(2, dtype=torch.int32))


# ---------------------------------------------------------------- FP8 decoding


def test_every_e4m3_code_decodes_exactly_under_every_kind_of_scale():
    codes = torch.arange(256, dtype=torch.uint8).view(8, 32)
    weight = codes.repeat(4, 1).view(torch.float8_e4m3fn)  # [32, 32]: every code under 32 row scales
    want_codes = torch.tensor([_e4m3_value(c) for c in range(256)], dtype=torch.float64).view(8, 32).repeat(4, 1)
    e8m0 = _e8m0([0, 1, 2, 60, 100, 126, 127, 128, 129, 150, 200, 240, 250, 252, 253, 254, 255] + [127] * 15)
    fp32 = torch.tensor([2.0**-127, 1e-30, 0.1, 1 / 3, 1.0, 7.0, 1e30, 3.4e38] * 4, dtype=torch.float32)
    for scale in (e8m0.view(32, 1), fp32.view(32, 1)):
        got = decode_fp8_block(weight, scale, (1, 32))
        want = (want_codes * _grid(scale, (1, 32), (32, 32))).float()
        assert got.dtype == torch.float32 and _same_bits(got, want)


@pytest.mark.parametrize("block", FP8_BLOCKS)
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (33, 65), (1, 31)])
def test_fp8_decoding_is_the_float64_product_rounded_once(block, shape):
    gen = torch.Generator().manual_seed(shape[0] * 1000 + block[0])
    weight = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    gm, gn = -(-shape[0] // block[0]), -(-shape[1] // block[1])
    e8m0 = torch.randint(90, 170, (gm, gn), dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu)
    fp32 = torch.rand((gm, gn), generator=gen) * 1e-2 + 1e-6
    for scale in (e8m0, fp32):
        want = (weight.to(torch.float64) * _grid(scale, block, shape)).float()
        assert _same_bits(decode_fp8_block(weight, scale, block), want)


@pytest.mark.parametrize("bad, message", [
    (dict(block=(64, 64)), r"FP8 block \(64, 64\) is not one of"),
    (dict(weight=torch.zeros(4, 64)), "not torch.float32"),
    (dict(scale=torch.zeros(1, 2, dtype=torch.uint8)), "not torch.uint8 .*ue8m0_from"),
    (dict(scale=torch.zeros(1, 3)), r"needs a scale of shape \[1, 2\], not \[1, 3\]"),
])
def test_fp8_decoding_refuses_what_is_not_the_format(bad, message):
    args = dict(weight=torch.zeros(4, 64, dtype=torch.float8_e4m3fn), scale=torch.ones(1, 2), block=(32, 32))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        decode_fp8_block(**args)


# ---------------------------------------------------------------- FP8 quantizing


def _deepseek_exponent(amax: float, qmax: float) -> int:
    """ceil(log2(float32(max(amax, float32(1e-4)) / qmax))), exactly."""
    floor = float(torch.tensor(1e-4, dtype=torch.float32))
    q = float(torch.tensor(max(amax, floor) / qmax, dtype=torch.float32))
    mantissa, exponent = math.frexp(q)
    return exponent - 1 if mantissa == 0.5 else exponent


@pytest.mark.parametrize("block", FP8_BLOCKS)
@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (5, 40)])
def test_fp8_quantizing_follows_deepseeks_scales_and_round_trips(block, shape):
    gen = torch.Generator().manual_seed(shape[1])
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[1])  # columns of every size
    w[: block[0], : block[1]] = 0.0  # an all-zero block
    for encoding in ("ue8m0", "fp32"):
        weight, scale = quantize_fp8_block(w, block, encoding)
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == w.shape
        assert scale.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        decoded = decode_fp8_block(weight, scale, block)
        per_element = _grid(scale, block, shape).float()
        # Nearest E4M3: within half an ulp, 2^-4 relative for normals, 2^-10 of the scale below.
        assert bool(((decoded - w).abs() <= torch.maximum(w.abs() * 2.0**-4, per_element * 2.0**-10)).all())
        if encoding == "ue8m0":  # its own values come back (a block's scale may halve, its codes double)
            assert torch.equal(decode_fp8_block(*quantize_fp8_block(decoded, block), block), decoded)
        for i, j in ((0, 0), (scale.shape[0] - 1, scale.shape[1] - 1)):  # the zero block, the partial corner
            amax = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].abs().max().item()
            if encoding == "ue8m0":
                assert scale.dtype == torch.float8_e8m0fnu
                assert scale.view(torch.uint8)[i, j].item() == _deepseek_exponent(amax, 448.0) + 127
            else:
                assert scale[i, j].item() == float(torch.tensor(max(amax, 1e-4), dtype=torch.float32) / 448)


def test_fp8_partial_blocks_scale_by_what_they_hold():
    w = torch.full((130, 130), 0.001)
    w[128:, 128:] = 448.0 * 4  # the corner block holds only a 2 x 2 piece of the weight
    _, scale = quantize_fp8_block(w, (128, 128))
    assert scale.view(torch.uint8).tolist() == [[127 - 18, 127 - 18], [127 - 18, 129]]


@pytest.mark.parametrize("bad, message", [
    (dict(w=torch.tensor([[1.0, NAN]])), "non-finite"),
    (dict(block=(128, 32)), r"\(128, 32\) is not one of"),
    (dict(scale_encoding="e4m3"), "'e4m3' is not one of"),
    (dict(w=torch.ones(2, 3, 4)), r"not \[2, 3, 4\]"),
])
def test_fp8_quantizing_refuses_bad_input(bad, message):
    args = dict(w=torch.ones(4, 32), block=(32, 32), scale_encoding="ue8m0")
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        quantize_fp8_block(**args)


# ---------------------------------------------------------------- FP4


def test_every_e2m1_code_pair_decodes_exactly_low_nibble_first():
    packed = torch.arange(256, dtype=torch.uint8).repeat(5, 1).view(torch.int8)  # [5, 256]: 512 inputs a row
    scale = _e8m0([0, 60, 127, 200, 254] * 16).view(16, 5).T.contiguous()  # [5, 16], a scale per 32
    nibbles = [(b >> (4 * (i % 2))) & 0xF for b in range(256) for i in (0, 1)]  # element 2i low, 2i+1 high
    values = torch.tensor([_e2m1_value(n) for n in nibbles], dtype=torch.float64)
    per_element = scale.view(torch.uint8).double().apply_(_ue8m0_value).repeat_interleave(32, 1)
    got = decode_fp4(packed, scale)
    assert got.shape == (5, 512) and _same_bits(got, (values * per_element).float())
    assert _same_bits(decode_fp4(packed[:1], _e8m0([255] * 16).view(1, 16)), torch.full((1, 512), NAN))


def test_fp4_quantizing_packs_even_columns_low_and_rounds_ties_to_even():
    row = torch.zeros(64)
    row[:16] = torch.tensor([0.5, -6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 4.0, 3.0, -0.0, 1.0, 6.0, 1.5])
    packed, scale = quantize_fp4(row)
    assert scale.view(torch.uint8).tolist() == [127, 1]  # amax 6 -> 2^0; an all-zero group -> 2^-126
    # 0.25 -> 0 and 2.5 -> 2 (ties to the even code), 0.75 -> 1 and 1.75 -> 2, 3.5 -> 4, 5 -> 4 likewise.
    assert packed.view(torch.uint8)[:8].tolist() == [0xF1, 0x20, 0x42, 0x64, 0x86, 0x56, 0x28, 0x37]
    assert decode_fp4(packed, scale)[:16].tolist() == [0.5, -6, 0, 1, 1, 2, 2, 4, 4, -0.0, 4, 3, -0.0, 1, 6, 1.5]


def test_fp4_round_trips_and_is_exact_on_its_own_values():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(3, 40, 96, generator=gen) * torch.logspace(-4, 3, 96)
    packed, scale = quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (3, 40, 48)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 40, 3)
    decoded = decode_fp4(packed, scale)
    per_element = scale.view(torch.uint8).double().apply_(_ue8m0_value).float().repeat_interleave(32, -1)
    # Nearest E2M1: within half a step, a quarter of the scale below 2, at most a quarter of |w| above.
    assert bool(((decoded - w).abs() <= torch.maximum(w.abs() / 4, per_element / 4)).all())
    # Its own values come back exactly (a group whose maximum rounded down to 3 halves its scale).
    assert torch.equal(decode_fp4(*quantize_fp4(decoded)), decoded)


@pytest.mark.parametrize("packed, scale, message", [
    (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), "not torch.uint8"),
    (torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1), "scales are float8_e8m0fnu, not torch.float32"),
    (torch.zeros(2, 15, dtype=torch.int8), None, "30 inputs do not split into scale groups of 32"),
    (torch.zeros(2, 32, dtype=torch.int8), None, r"needs a scale of shape \[2, 2\], not \[2, 1\]"),
])
def test_fp4_decoding_refuses_what_is_not_the_format(packed, scale, message):
    scale = torch.zeros(2, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu) if scale is None else scale
    with pytest.raises(ValueError, match=message):
        decode_fp4(packed, scale)


# ---------------------------------------------------------------- DeepSeek's activation rule


def _act_quant_float64(x: torch.Tensor, group: int) -> torch.Tensor:
    """The rule written out per group in Python floats: scale, divide, one rounding, multiply."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for row in range(x.shape[0]):
        for start in range(0, x.shape[1], group):
            values = x[row, start : start + group].double()
            if not bool(torch.isfinite(values).all()):
                out[row, start : start + group] = NAN
                continue
            scale = 2.0 ** _deepseek_exponent(values.abs().max().item(), 448.0)
            codes = (values / scale).clamp(-448, 448).to(torch.float8_e4m3fn)  # one rounding, from float64
            out[row, start : start + group] = codes.double() * scale
    return out.float()


def test_act_quant_is_deepseeks_rule_per_token_per_128_channels():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 300, generator=gen) * torch.logspace(-6, 4, 300)
    x[1, :128] = 0.0  # the amax floor: scale 2^ceil(log2(1e-4 / 448)) = 2^-22
    x[2, 5] = 448.0 * 2.0**3  # exactly 448 * 2^k: scale 2^k, the element maps to 448
    x[3, 7] = 448.0 * 2.0**3 * (1 + 2.0**-23)  # one ulp above: the next power of two
    x[4, 130] = float("inf")  # a non-finite group: NaN, the other groups of the row unchanged
    got = act_quant_e4m3(x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert _same_bits(got, _act_quant_float64(x, 128))
    assert got[2, 5].item() == x[2, 5].item() and got[3, 7].item() == 448.0 * 2.0**3  # 224 * 2^4
    assert bool(torch.isnan(got[4, 128:256]).all()) and not bool(torch.isnan(got[4, :128]).any())
    assert _same_bits(act_quant_e4m3(x.to(torch.bfloat16)), _act_quant_float64(x.to(torch.bfloat16).float(), 128))


def test_act_quant_keeps_leading_dims_and_other_groups():
    x = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(8))
    assert _same_bits(act_quant_e4m3(x, group=32).view(6, 96), _act_quant_float64(x.view(6, 96), 32))


def test_act_quant_of_no_tokens_is_empty():
    assert act_quant_e4m3(torch.zeros(0, 3, 200)).shape == (0, 3, 200)


# ---------------------------------------------------------------- the format of a stored weight

FP8 = WeightFormat("fp8_e4m3", (128, 128), "fp32")
FP4 = WeightFormat("fp4_e2m1", (1, 32), "ue8m0")


def test_stored_tensors_follow_the_release_layout():
    # The ceiling grid of a partial block: 576 x 7168 in 128 x 128 blocks is 5 x 56.
    assert (FP8.data_dtype, FP8.data_shape((576, 7168)), FP8.scale_shape((576, 7168))) == \
        ("float8_e4m3fn", (576, 7168), (5, 56))
    assert FP8.nbytes((576, 7168)) == 576 * 7168 + 5 * 56 * 4
    # FP4 experts: two values a byte, a UE8M0 scale per 32 inputs, the expert axis kept.
    assert (FP4.data_dtype, FP4.data_shape((4, 256, 128)), FP4.scale_shape((4, 256, 128)), FP4.scale_dtype) == \
        ("int8", (4, 256, 64), (4, 256, 4), "float8_e8m0fnu")
    assert FP4.nbytes((4, 256, 128)) == 4 * 256 * (64 + 4)
    assert (FP32.nbytes((3, 5)), WeightFormat("bf16").nbytes((3, 5)), FP32.scale_shape((3, 5))) == (60, 30, None)


@pytest.mark.parametrize("args, fragment", [
    (("fp8_e4m3", (64, 64), "ue8m0"), "block: 64x64 is not a block fp8_e4m3 takes (128x128, 32x32, 1x32)"),
    (("fp8_e4m3", None, "ue8m0"), "block: fp8_e4m3 needs a block"),
    (("fp8_e4m3", (32, 32), None), "scale_encoding: fp8_e4m3 needs a scale encoding (ue8m0, fp32)"),
    (("fp4_e2m1", (32, 32), "ue8m0"), "block: 32x32 is not the block fp4_e2m1 takes (1x32)"),
    (("fp4_e2m1", (1, 32), "fp32"), "scale_encoding: 'fp32' is not the scale encoding fp4_e2m1 takes (ue8m0)"),
    (("bf16", None, "ue8m0"), "scale_encoding: bf16 carries no scale"),
    (("fp32", (1, 32), None), "block: fp32 has no block"),
    (("int4", None, None), "kind: 'int4' is not one of fp32, bf16, fp8_e4m3, fp4_e2m1"),
])
def test_a_combination_the_format_cannot_take_is_refused(args, fragment):
    with pytest.raises(ValueError) as info:
        WeightFormat(*args)
    assert fragment in str(info.value)


def test_json_round_trip_is_strict():
    for fmt in (FP32, WeightFormat("bf16"), FP8, FP4):
        assert WeightFormat.from_json(fmt.to_json(), "f") == fmt
    assert FP32.to_json() == {"kind": "fp32"} and FP4.describe() == "fp4_e2m1 1x32 ue8m0"
    for data, fragment in [({"kind": "fp8_e4m3", "block": [32, 32], "scale_encoding": "ue8m0", "x": 1}, "is not {kind}"),
                           ({"kind": "fp8_e4m3", "block": [32, True], "scale_encoding": "ue8m0"}, "f.block:"),
                           ({"kind": "fp8_e4m3", "block": [32, 32], "scale_encoding": "e8m0"}, "f.scale_encoding:"),
                           ("fp32", "is not {kind}")]:
        with pytest.raises(ValueError) as info:
            WeightFormat.from_json(data, "f")
        assert fragment in str(info.value)
