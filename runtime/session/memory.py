"""How much memory a session's page pools may take when the caller sizes nothing.

As vLLM's `--gpu-memory-utilization`: the pools get a fraction of the device's free memory,
measured when the session opens (after its weights are placed, so they are already out of
it), less what the session's other buffers will take (per-slot rings, staging, block
tables, the buckets' static inputs and outputs). A session never takes more than every slot
at max_seq_len needs, so a small session keeps exactly the pools it always had.

On CPU, large buffers are zero pages of an anonymous mapping (`zeros`): the kernel commits
a page of memory when it is first written, so resident memory follows the pages requests
write, not the pools' capacity; torch.zeros would write (and so commit) every byte at open.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

CUDA_FRACTION = 0.9  # vLLM's default gpu_memory_utilization: the device serves this process alone
CPU_FRACTION = 0.25  # host memory is shared with everything else running on the machine
LAZY_BYTES = 1 << 20  # smaller CPU buffers are ordinary torch.zeros: a mapping per buffer is not worth it


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


def zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape), whose memory on CPU is committed as it is written (module docstring)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes)  # anonymous: zero-filled, committed page by page on first write
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps `pages` alive
