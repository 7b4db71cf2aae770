"""The process group a parallel recipe's rank is captured in: torch's fake backend.

A rank's graphs call functional collectives on the default group, so capturing them
needs one; the fake backend gives this process any rank of any world size without
peers, so every rank of a mapping exports on one CPU machine, one after another or in
worker processes. The graphs record the group's name ("0", the default group's in every
process) and size, which the runtime checks against the real group at load.
"""

from __future__ import annotations

from contextlib import contextmanager

from b12x_toolchain.exporter.errors import ExportError


@contextmanager
def rank_group(d, rank: int | None):
    if rank is None:
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ExportError(f"rank {rank}: this process already has a default process group; a parallel recipe's "
                          "ranks are captured on torch's fake backend, in a process without one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=d.world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
