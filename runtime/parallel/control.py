"""Rank 0's messages to the other ranks of a served package, on a gloo group of their own.

A message is a list of operations, each a JSON list `[name, *arguments]` (a tensor travels as
the lists of its values): plain data, never pickled, so a worker runs nothing it was sent
but the operations of its table (lockstep.py). Rank 0 broadcasts one frame of fixed size,
the length then the bytes (a longer message's rest follows in a second broadcast). The
group is CPU (gloo) whatever the model's device: the model's own collectives keep their
group (NCCL on CUDA).

Every call here is bound by the group's timeout, the step deadline: a rank that died
closes its connections and the others fail at once; one that hangs makes them fail when
the deadline passes. Either way the caller gets `RankLost`, naming what failed, instead of
waiting on a collective for ever.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch

FRAME = 16 << 10  # bytes broadcast per message: a step's operations fit in one collective


class RankLost(RuntimeError):
    """Another rank died, hung past the step deadline or failed: the group cannot go on."""


def encode(ops: list) -> bytes:
    return json.dumps(ops, default=_plain, separators=(",", ":")).encode()


def decode(data: bytes) -> list:
    return json.loads(data)


def _plain(value):
    """A tensor as the nested lists of its values: replay inputs are ids and counts, which the
    receiving session reads in its own dtypes."""
    from b12x_toolchain.runtime.session.validate import OnDevice

    if isinstance(value, OnDevice):  # verify's block from rank 0's draft pass: its values, read once here
        value = value.tensor
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    raise TypeError(f"a step message carries plain data and tensors, not {type(value).__name__}")


def lost(exc: RuntimeError, rank: int, world_size: int, what: str, limit_s: float) -> RankLost | None:
    """The RankLost that torch.distributed's error means (a peer closed or timed out), else None."""
    text = str(exc)
    timed_out = "imeout" in text or "imed out" in text
    if not (timed_out or "closed" in text or "reset" in text or "Broken pipe" in text):
        return None
    why = f"did not answer within {limit_s:g} s" if timed_out else "went away"
    return RankLost(f"rank {rank} of {world_size}: a peer {why} during {what} "
                    f"({text.splitlines()[0][:200] if text else type(exc).__name__})")


class ControlChannel:
    """Rank 0 sends, every other rank receives; `agree` and `gather` answer back."""

    def __init__(self, deadline_s: float, join_timeout_s: float):
        """Until `started()`, a peer may take join_timeout_s (loading, opening its session); after
        it, this group and the model's (the default group) wait deadline_s at most."""
        import torch.distributed as dist

        self.deadline_s = deadline_s
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=join_timeout_s))
        self.limit_s = join_timeout_s

    def started(self) -> None:
        """Every rank is up: from now on each collective, ours and the model's, has the step deadline."""
        from torch.distributed.distributed_c10d import _set_pg_timeout

        for group in (self.group, None):
            _set_pg_timeout(timedelta(seconds=self.deadline_s), group)
        self.limit_s = self.deadline_s

    def _collective(self, what: str, call):
        try:
            return call()
        except RuntimeError as exc:
            error = lost(exc, self.rank, self.world_size, what, self.limit_s)
            if error is None:
                raise
            raise error from None

    def send(self, ops: list) -> None:
        import torch.distributed as dist

        data = encode(ops)
        frame = torch.zeros(FRAME, dtype=torch.uint8)  # the length, then as much of the message as fits
        frame[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        head = min(len(data), FRAME - 8)
        if head:
            frame[8 : 8 + head] = torch.frombuffer(bytearray(data[:head]), dtype=torch.uint8)
        self._collective("a step message", lambda: dist.broadcast(frame, 0, group=self.group))
        if len(data) > head:  # a long message (a long prompt's snapshot tokens): the rest in a second broadcast
            rest = torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8)
            self._collective("a step message", lambda: dist.broadcast(rest, 0, group=self.group))

    def receive(self) -> list:
        import torch.distributed as dist

        frame = torch.empty(FRAME, dtype=torch.uint8)
        self._collective("waiting for rank 0", lambda: dist.broadcast(frame, 0, group=self.group))
        size = int.from_bytes(frame[:8].numpy().tobytes(), "little")
        data = frame[8 : 8 + min(size, FRAME - 8)].numpy().tobytes()
        if size > len(data):
            rest = torch.empty(size - len(data), dtype=torch.uint8)
            self._collective("a step message", lambda: dist.broadcast(rest, 0, group=self.group))
            data += rest.numpy().tobytes()
        return decode(data)

    def agree(self, ok: bool) -> bool:
        """Whether every rank says ok (an all-reduce; each rank calls it at the same point)."""
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        self._collective("an agreement", lambda: dist.all_reduce(flag, dist.ReduceOp.MIN, group=self.group))
        return bool(flag.item())

    def gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (one length on every rank), in rank order, on every rank."""
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._collective("a report", lambda: dist.all_gather(out, mine, group=self.group))
        return [t.tolist() for t in out]
