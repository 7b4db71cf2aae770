"""The one device check of the runtime: which devices a session can run on, here and now.

Every way of opening a session — the loader API (`load(path).session(device=...)`),
`b12x run --device` and `b12x serve --device` — goes through Session, which turns its
device into a concrete one here (validate.concrete_device) before any weight or buffer is
placed. A device the runtime cannot use is refused with a DeviceError naming the device
and why; without this check the first sign would be a torch assertion deep inside the
first allocation, or a graph captured on another GPU than the one asked for.

The runtime runs on two device types: cpu, and cuda (a bare "cuda" is the current CUDA
device of the calling thread, "cuda:N" the N-th device torch sees).
"""

from __future__ import annotations

import torch

SUPPORTED = ("cpu", "cuda")
EXPECTED = "expected cpu, cuda or cuda:N"


class DeviceError(ValueError):
    """A session's device is one this runtime cannot run on here; names the device and why."""


def session_device(device) -> torch.device:
    """`device` as the tensors placed on it will report theirs (cpu, or cuda:N), or a DeviceError."""
    parsed = _parse(device)
    if parsed.type == "cpu":
        # One CPU device: tensors made on "cpu:0" report "cpu", and buffers are compared by device.
        return torch.device("cpu")
    if parsed.type != "cuda":
        raise DeviceError(f"device {device}: sessions run on {' or '.join(SUPPORTED)}, not {parsed.type}; "
                          f"{EXPECTED}")
    return _cuda(str(device), parsed.index)


def _parse(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):  # torch's message lists every device type it knows
        raise DeviceError(f"device {device}: not a device torch can read; {EXPECTED}") from None


def _cuda(named: str, index: int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise DeviceError(f"device {named}: torch reports no CUDA device ({_torch_build()})")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if index is None else index
    if index >= count:
        seen = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise DeviceError(f"device {named}: torch sees {count} CUDA device{'s' * (count != 1)} ({seen})")
    return torch.device("cuda", index)


def _torch_build() -> str:
    """Why torch may see no CUDA device: a build without CUDA, or none visible to this process."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__}, built without CUDA"
    return f"torch {torch.__version__}, built for CUDA {torch.version.cuda}; no device is visible to this process"


def make_current(device: torch.device) -> None:
    """Make a CUDA `device` the calling thread's current device (nothing for cpu).

    The current device and its current stream are per thread, and a CUDA graph is captured
    and replayed on the current stream: the thread that prepares a session and replays it
    makes its device current first."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
