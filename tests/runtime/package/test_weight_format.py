"""A weight's storage format: the combinations it takes, its stored tensors and bytes, its JSON."""

from __future__ import annotations

import pytest

from b12x_toolchain.runtime.package.weight_format import FP32, WeightFormat

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
