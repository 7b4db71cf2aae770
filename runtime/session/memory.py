"""How much memory a session's page pools may take when the caller sizes nothing.

As vLLM's `--gpu-memory-utilization`: the pools get a fraction of the device's free memory,
measured when the session opens (after its weights are placed, so they are already out of
it), less what the session's other buffers will take (per-slot rings, staging, block
tables, the buckets' static inputs and outputs). A session never takes more than every slot
at max_seq_len needs, so a small session keeps exactly the pools it always had.

On CUDA the budget also leaves CAPTURE_HEADROOM_BYTES free for what preparing the passes
takes beside those buffers: the CUDA-graph pool every captured graph shares (the
intermediates of the largest bucket's pass) and the kernels' workspaces (cuBLAS, Triton,
loaded modules), which no manifest states. What capture really took is measured around each
capture (`device_memory`, `capture_taken`) and recorded in `session.memory_budget`
(graph_pool_bytes, workspace_bytes); a session that took more than its memory_fraction, or
that ran out of memory while capturing, is a SessionMemoryError that says by how many bytes
it does not fit and what to change. A CPU session captures no CUDA graph: it reserves
nothing and measures nothing.

On CPU, large buffers are zero pages of an anonymous mapping (`zeros`): the kernel commits
a page of memory when it is first written, so resident memory follows the pages requests
write, not the pools' capacity; torch.zeros would write (and so commit) every byte at open.
"""

from __future__ import annotations

import math
import mmap
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CUDA_FRACTION = 0.9  # vLLM's default gpu_memory_utilization: the device serves this process alone
CPU_FRACTION = 0.25  # host memory is shared with everything else running on the machine
LAZY_BYTES = 1 << 20  # smaller CPU buffers are ordinary torch.zeros: a mapping per buffer is not worth it
# CUDA: left free by the default budget for the graph pool and the kernels' workspaces (module
# docstring). 1 GiB holds the intermediates of a full-size pass at the buckets' rows with room
# for cuBLAS's and Triton's workspaces; what capture took is measured, and exceeding it is an error.
CAPTURE_HEADROOM_BYTES = 1 << 30
# What a session that does not fit can change, in the loader API's names.
SMALLER = "give fewer pages, a smaller cache_bytes or fewer slots"


class SessionMemoryError(ValueError):
    """A session does not fit the device's memory: says by how many bytes and what to change."""


def default_fraction(device: torch.device) -> float:
    return CUDA_FRACTION if device.type == "cuda" else CPU_FRACTION


def free_bytes(device: torch.device) -> int:
    """Memory a session opened now could still take: the device's free memory on CUDA,
    MemAvailable (/proc/meminfo) elsewhere."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("/proc/meminfo has no MemAvailable; give the session pages or cache_bytes")


def capture_headroom(device: torch.device) -> int:
    """Bytes the default budget leaves free for capture on `device`: none off CUDA."""
    return CAPTURE_HEADROOM_BYTES if device.type == "cuda" else 0


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a CUDA device's memory."""

    free: int  # free on the device (torch.cuda.mem_get_info), whoever took the rest
    reserved: int  # held by torch's caching allocator (torch.cuda.memory_reserved), graph pools included


def device_memory(device: torch.device) -> DeviceMemory:
    return DeviceMemory(torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device))


def capture_taken(before: DeviceMemory, after: DeviceMemory) -> dict[str, int]:
    """What the device lost between two readings around a capture: graph_pool_bytes, the
    caching allocator's growth (the graphs' private pool, and blocks warm-up left cached), and
    workspace_bytes, the rest of the free memory that went (cuBLAS and Triton workspaces,
    loaded kernel modules: memory the allocator does not hold)."""
    pool = max(after.reserved - before.reserved, 0)
    return {"graph_pool_bytes": pool, "workspace_bytes": max(before.free - after.free - pool, 0)}


def after_capture(budget: dict | None, taken: dict[str, int], free_now: int, device: torch.device) -> dict:
    """session.memory_budget once every bucket is captured: `budget` (what sized the default
    pools, or None when pages or cache_bytes did) with what capture took. A session whose
    pools a budget sized must have kept to memory_fraction of the memory free when it opened;
    otherwise capture took more than the headroom left for it, and the session is refused."""
    record = dict(budget or {}) | taken
    if budget is None:
        return record  # the caller sized the pools: no share of the device to keep to
    used = budget["free_bytes"] - free_now
    allowed = int(budget["memory_fraction"] * budget["free_bytes"])
    record["used_bytes"] = used
    if used > allowed:
        raise SessionMemoryError(
            f"the session does not fit on {device} by {used - allowed} bytes: it took {used} bytes, more than "
            f"memory_fraction {budget['memory_fraction']} of the {budget['free_bytes']} bytes free when it opened "
            f"({allowed} bytes), because capture took {taken['graph_pool_bytes']} bytes of graph pool and "
            f"{taken['workspace_bytes']} bytes of workspaces against the {budget.get('capture_headroom_bytes', 0)} "
            f"bytes left for them. {SMALLER.capitalize()} (at least {used - allowed} bytes less), or raise "
            "memory_fraction")
    return record


_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _requested_bytes(message: str) -> int | None:
    """The allocation torch's out-of-memory message says it could not make ("Tried to allocate 2.00 GiB")."""
    found = re.search(r"Tried to allocate ([\d.]+) (bytes|B|KiB|MiB|GiB|TiB)", message)
    return None if found is None else int(float(found.group(1)) * _UNITS[found.group(2)])


def capture_out_of_memory(where: str, device: torch.device, taken: dict[str, int], free_now: int,
                          exc: BaseException) -> SessionMemoryError:
    """The error for a capture that ran out of device memory: by how much, and what to change."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    requested = _requested_bytes(str(exc))
    if requested is None:
        short = f"by more than the {free_now} bytes still free"
    else:  # above what is free; a fragmented device may refuse less than it has free
        short = f"by at least {requested - free_now if requested > free_now else requested} bytes"
    return SessionMemoryError(
        f"capturing {where} on {device} ran out of device memory: the session does not fit {short} (capture had "
        f"taken {taken['graph_pool_bytes']} bytes of graph pool and {taken['workspace_bytes']} bytes of workspaces; "
        f"the default budget leaves {CAPTURE_HEADROOM_BYTES} bytes for them). {SMALLER.capitalize()}, or lower "
        f"memory_fraction (torch: {reason})")


def zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), whose memory on CPU is committed as it is written (module docstring)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes)  # anonymous: zero-filled, committed page by page on first write
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps `pages` alive
