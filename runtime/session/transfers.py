"""A session's traffic between host and device, arranged so that the host never waits for
the device but once per engine step.

Inputs go up from pinned host memory with `non_blocking=True`: the copy is queued on the
stream behind the previous replay and the host goes on (a copy from pageable memory would
wait for the stream to drain). torch's pinned-memory cache keeps a block until the copies
queued from it have run, so a replay's host rows may be dropped at once.

Results come down through `download`: every tensor the host needs from one step, packed into
one buffer, copied once into pinned memory, and one wait for that copy. That wait is the
step's only synchronisation with the device (tests count the calls).
"""

from __future__ import annotations

import math

import torch


def upload(static: torch.Tensor, rows: list) -> None:
    """Write host rows (nested lists of ints, as many as `static` has) into a static input."""
    pinned = static.device.type == "cuda"
    static.copy_(torch.tensor(rows, dtype=static.dtype, device="cpu", pin_memory=pinned), non_blocking=pinned)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new device tensor of host values (lists or a CPU tensor), copied without waiting."""
    pinned = device.type == "cuda"
    if isinstance(values, torch.Tensor):
        host = values.to(dtype).pin_memory() if pinned else values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype, device="cpu", pin_memory=pinned)
    return host.to(device, non_blocking=pinned)


def download(lists: dict[str, torch.Tensor] | None = None,
             tensors: dict[str, torch.Tensor] | None = None) -> dict[str, list | torch.Tensor]:
    """One device-to-host transfer of several device tensors: `lists` come back as nested
    Python lists (of ints for integer tensors), `tensors` as float64 CPU tensors.

    They travel as one float64 buffer: token ids and counts are exact in it (below 2**53),
    float32 logits and probabilities too."""
    items = {**(lists or {}), **(tensors or {})}
    if not items:
        return {}
    device = next(iter(items.values())).device
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in items.values()])
    pinned = device.type == "cuda"
    host = torch.empty(flat.shape, dtype=torch.float64, device="cpu", pin_memory=pinned)
    host.copy_(flat, non_blocking=pinned)
    if pinned:
        torch.cuda.current_stream(device).synchronize()  # the step's one wait: this copy
    out, start = {}, 0
    for name, tensor in items.items():
        size = math.prod(tensor.shape)
        piece = host[start : start + size].reshape(tensor.shape)
        start += size
        if name in (lists or {}):
            integral = not (tensor.dtype.is_floating_point or tensor.dtype.is_complex)
            out[name] = (piece.to(torch.int64) if integral else piece).tolist()
        else:
            out[name] = piece
    return out
