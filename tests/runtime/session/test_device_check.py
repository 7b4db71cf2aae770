"""The one device check (runtime/session/device.py): every way of opening a session refuses a
device the runtime cannot use with one DeviceError that names the device and why, before any
weight is placed. CUDA's presence is faked where a test needs it: torch here may have none."""

from __future__ import annotations

import re

import pytest
import torch

from b12x_toolchain.runtime.session.device import DeviceError, session_device


def with_cuda(monkeypatch, count: int, current: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


@pytest.mark.parametrize("device, expected", [
    ("cpu", torch.device("cpu")),
    ("cpu:0", torch.device("cpu")),  # what tensors made there report
    (torch.device("cpu"), torch.device("cpu")),
    ("cuda", torch.device("cuda", 1)),  # the current device
    ("cuda:0", torch.device("cuda", 0)),
    (torch.device("cuda", 1), torch.device("cuda", 1)),
])
def test_usable_devices_are_made_concrete(monkeypatch, device, expected):
    with_cuda(monkeypatch, 2, current=1)
    assert session_device(device) == expected


@pytest.mark.parametrize("device, message", [
    ("cuda:3", r"^device cuda:3: torch sees 2 CUDA devices \(cuda:0 to cuda:1\)$"),
    ("mps", r"^device mps: sessions run on cpu or cuda, not mps; expected cpu, cuda or cuda:N$"),
    ("meta", r"^device meta: sessions run on cpu or cuda, not meta"),
    ("gpu", r"^device gpu: not a device torch can read; expected cpu, cuda or cuda:N$"),
    ("cuda:x", r"^device cuda:x: not a device torch can read"),
    (None, r"^device None: not a device torch can read"),
])
def test_devices_the_runtime_cannot_use_are_refused_by_name(monkeypatch, device, message):
    with_cuda(monkeypatch, 2)
    with pytest.raises(DeviceError, match=message):
        session_device(device)


def test_one_cuda_device_is_named_alone(monkeypatch):
    with_cuda(monkeypatch, 1)
    with pytest.raises(DeviceError, match=r"^device cuda:1: torch sees 1 CUDA device \(cuda:0\)$"):
        session_device("cuda:1")


def test_cuda_without_a_device_says_why(monkeypatch):
    with_cuda(monkeypatch, 0)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(DeviceError, match=rf"^device cuda: torch reports no CUDA device \(torch "
                                          rf"{re.escape(torch.__version__)}, built without CUDA\)$"):
        session_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(DeviceError, match=r"^device cuda:0: torch reports no CUDA device \(torch .*, built for "
                                          r"CUDA 13.0; no device is visible to this process\)$"):
        session_device("cuda:0")


# Ids other than the bare device: a test whose keywords hold "cuda" is skipped without a GPU (conftest.py).
@pytest.mark.parametrize("device", ["cuda", "cuda:3", "mps", "bogus"], ids=lambda d: f"device={d}")
def test_the_loader_api_refuses_before_placing_weights(fused_pkg, monkeypatch, device):
    """A DeviceError is a ValueError, as the CLIs report it (one line, exit 1)."""
    placed = []
    monkeypatch.setattr("b12x_toolchain.runtime.session.session.place_weights", lambda *a: placed.append(a))
    if torch.cuda.is_available():
        with_cuda(monkeypatch, 1)  # cuda:0 is usable there: ask for one that is not
        device = "cuda:3" if device == "cuda" else device
    with pytest.raises(ValueError, match=rf"^device {device}: ") as refused:
        fused_pkg.session(device=device)
    assert isinstance(refused.value, DeviceError) and placed == []
