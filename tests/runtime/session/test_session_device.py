"""A session opened on a bare "cuda" checks its buffers against the device its tensors
report (cuda:N): torch.device("cuda") != torch.device("cuda:0"), so a session that kept
"cuda" refused its own cache buffers on a GPU."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.session.validate import BufferError, check_buffer, concrete_device


def test_a_bare_cuda_is_the_current_cuda_device_and_others_stay(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert concrete_device("cuda") == torch.device("cuda", 1)
    assert concrete_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert concrete_device("cuda:2") == torch.device("cuda", 2)
    assert concrete_device("cpu") == torch.device("cpu")
    assert torch.device("cuda") != torch.device("cuda", 0)  # why the session needs the index


def test_a_buffer_on_another_device_is_refused_by_name(fused_pkg):
    spec = next(s for info in fused_pkg.passes.values() for s in info.inputs if s.role == "cache")
    shape = spec.resolve({"slots": 2, "rows": 1, **{name: 1 for name in spec.shape if isinstance(name, str)}})
    tensor = torch.zeros(shape, dtype=spec.torch_dtype, device="meta")
    with pytest.raises(BufferError, match=f"{spec.name}: on device meta; the session runs on cpu"):
        check_buffer(spec, tensor, shape, concrete_device("cpu"))
    check_buffer(spec, torch.zeros(shape, dtype=spec.torch_dtype), shape, concrete_device("cpu"))
