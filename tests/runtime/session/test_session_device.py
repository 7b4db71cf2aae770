"""A session opened on a bare "cuda" checks its buffers against the device its tensors
report (cuda:N): torch.device("cuda") != torch.device("cuda:0"), so a session that kept
"cuda" refused its own cache buffers on a GPU."""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.session.validate import concrete_device


def test_a_bare_cuda_is_the_current_cuda_device_and_others_stay(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # torch here may have no CUDA device:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)  # the device check (device.py) asks
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert concrete_device("cuda") == torch.device("cuda", 1)
    assert concrete_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert concrete_device("cuda:2") == torch.device("cuda", 2)
    assert concrete_device("cpu") == torch.device("cpu")
    assert torch.device("cuda") != torch.device("cuda", 0)  # why the session needs the index

