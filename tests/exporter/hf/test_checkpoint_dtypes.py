"""The checkpoint reader (runtime/package/checkpoint.py) binds weights stored in their
storage formats: E4M3 data (F8_E4M3), UE8M0 scales (F8_E8M0) and packed E2M1 (I8)."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from b12x_toolchain.runtime.package.abi import DTYPES
from b12x_toolchain.runtime.package.checkpoint import (
    DTYPE_CODES,
    SINGLE,
    CheckpointError,
    read_checkpoint,
    tensor_sha256,
)

STORED = {
    "attn.weight": torch.tensor([[0.5, -1.0], [448.0, 0.0]]).to(torch.float8_e4m3fn),
    "attn.weight_scale": torch.tensor([1.0, 0.25, 8.0]).to(torch.float8_e8m0fnu),
    "experts.w1": torch.tensor([[0x21, -0x10, 0x7F]], dtype=torch.int8),
}


@pytest.fixture()
def ckpt(tmp_path):
    safetensors.torch.save_file(STORED, str(tmp_path / SINGLE))
    return tmp_path


def test_every_code_names_a_calling_convention_dtype():
    assert {"F8_E4M3", "F8_E8M0", "I8"} <= set(DTYPE_CODES)
    assert set(DTYPE_CODES.values()) <= set(DTYPES)


def test_fp8_scale_and_packed_fp4_tensors_are_read_as_stored(ckpt):
    expected = {"attn.weight": ("float8_e4m3fn", (2, 2)), "attn.weight_scale": ("float8_e8m0fnu", (3,)),
                "experts.w1": ("int8", (1, 3))}
    sums = {name: tensor_sha256(tensor) for name, tensor in STORED.items()}
    got = read_checkpoint(ckpt, expected, sums)
    for name, tensor in STORED.items():
        assert got[name].dtype == tensor.dtype
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8))


def test_a_storage_dtype_other_than_the_packages_is_named(ckpt):
    with pytest.raises(CheckpointError, match=r"^attn\.weight: dtype float8_e4m3fn in model\.safetensors does not "
                                              r"match the package's bfloat16"):
        read_checkpoint(ckpt, {"attn.weight": ("bfloat16", (2, 2))})
    with pytest.raises(CheckpointError, match=r"^experts\.w1: dtype int8 in model\.safetensors does not match the "
                                              r"package's uint8"):
        read_checkpoint(ckpt, {"experts.w1": ("uint8", (1, 3))})
