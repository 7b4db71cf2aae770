"""Run a function on every rank of a gloo process group, in real processes.

`on_ranks(fn, world_size, *args)` starts one process per rank, initialises the default
group over a fresh file store, calls fn(rank, *args) and returns each rank's result in
rank order; a rank that raises fails the call with its traceback.

The rank processes are forked from the test's process: torch, the project and the test
module are already imported there (a spawned rank imports them again, about 4 s of CPU
each), and the tests run one torch thread, so no thread pool is left half-copied.
"""

from __future__ import annotations

import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank, world_size, store_path, fn, args, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        results[rank] = ("ok", fn(rank, *args))
    except BaseException:  # noqa: BLE001 - carried to the parent, which re-raises
        results[rank] = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()


def on_ranks(fn, world_size: int, *args):
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_run, args=(world_size, str(Path(tmp) / "store"), fn, args, results), nprocs=world_size,
                           join=True, start_method="fork")
        out = []
        for rank in range(world_size):
            status, value = results[rank]
            if status == "error":
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{value}")
            out.append(value)
        return out
