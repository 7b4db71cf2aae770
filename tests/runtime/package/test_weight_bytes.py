"""A package's weights read from the checked bytes, in every dtype a package stores
(safetensors.torch.load 0.8.0 has no torch dtype for F8_E8M0, the UE8M0 scales')."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.package.weight_binding import load_weights_bytes


def test_every_stored_dtype_reads_back_byte_for_byte():
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "fp32": torch.randn(3, 4, generator=gen),
        "bf16": torch.randn(3, 4, generator=gen).bfloat16(),
        "fp8": torch.randn(2, 64, generator=gen).to(torch.float8_e4m3fn),
        "scale": torch.randint(100, 140, (2, 2), generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "fp4": torch.randint(-128, 128, (2, 32), generator=gen, dtype=torch.int8),
        "table": torch.arange(6).view(3, 2),
        "empty": torch.zeros(0, 4),
    }
    data = safetensors.torch.save(tensors)
    with pytest.raises(KeyError):  # why the package reader does not call it
        safetensors.torch.load(data)
    got = load_weights_bytes(data, "weights.safetensors")
    assert set(got) == set(tensors)
    for name, tensor in tensors.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_dtype_no_package_stores_and_malformed_bytes_are_refused():
    data = safetensors.torch.save({"half": torch.zeros(2, dtype=torch.float16)})
    with pytest.raises(PackageError, match=r"^weights.safetensors: tensor half is F16, not a dtype a package stores"):
        load_weights_bytes(data, "weights.safetensors")
    with pytest.raises(PackageError, match=r"^weights.safetensors: not a valid safetensors file"):
        load_weights_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "weights.safetensors")
