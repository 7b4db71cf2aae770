"""A package's weights read from the checked bytes, in every dtype a package stores
(safetensors.torch.load 0.8.0 has no torch dtype for F8_E8M0, the UE8M0 scales')."""

from __future__ import annotations

import json

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


def test_tensors_view_the_bytes_read_without_a_copy():
    """Every tensor is a view of the one buffer the file was read into (which was hashed):
    a copy per tensor would hold the weights twice while loading."""
    tensors = {"fp32": torch.ones(5, 3), "bf16": torch.ones(4, dtype=torch.bfloat16),
               "fp8": torch.ones(7, 32).to(torch.float8_e4m3fn), "fp4": torch.ones(3, 16, dtype=torch.int8),
               "table": torch.arange(3)}
    data = bytearray(safetensors.torch.save(tensors))
    buffer = torch.frombuffer(data, dtype=torch.uint8)
    got = load_weights_bytes(data, "weights.safetensors")
    for name, tensor in got.items():
        assert tensor.dtype == tensors[name].dtype, name
        assert tensor.untyped_storage().data_ptr() == buffer.data_ptr(), name
        assert tensor.untyped_storage().nbytes() == len(data), name
    data[-1] ^= 0xFF  # the last tensor stored (1-byte dtypes come last) sees its bytes change in place
    assert any(not torch.equal(got[n].view(torch.uint8), tensors[n].view(torch.uint8)) for n in ("fp8", "fp4"))


@pytest.mark.parametrize("header, problem", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, r"tensor a: 4 bytes for F32 \[2\]"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, r"tensor a starts at data byte 4, not 0"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, r"the tensors cover 4 of the 8 data bytes"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, r"tensor a: shape \[-1\] is not a list of sizes"),
    ({"a": {"dtype": "F32", "shape": [1]}}, r"tensor a: expected exactly dtype, shape and data_offsets"),
])
def test_a_header_that_does_not_tile_the_data_is_refused(header, problem):
    text = json.dumps(header).encode()
    data = len(text).to_bytes(8, "little") + text + bytes(8)
    with pytest.raises(PackageError, match=r"^weights.safetensors: not a valid safetensors file \(" + problem):
        load_weights_bytes(data, "weights.safetensors")
