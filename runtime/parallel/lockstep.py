"""Ranks in lockstep: rank 0 decides, every rank makes the same changes to its own session.

Rank 0 runs the engine (scheduler, sampling, acceptance, the prefix cache's choices) on a
`LeaderSession`: every call that changes a session — a replay with its inputs, a slot reset,
retired or given a committed length, pages reserved, a prefix snapshot captured, hydrated or
dropped — is recorded as an operation and sent to the other ranks in one message before the
next replay (whose collectives every rank must enter together). The other ranks run
`follow`: they make each operation on their own session and shard, and never sample,
schedule or look anything up on their own. So early stops, prefix hits, cancellations and
sampling cannot make ranks diverge: there is one decision per step, rank 0's.

Operations are plain data (control.py); a worker runs only the entries of `OPERATIONS`.
"""

from __future__ import annotations

import sys
import time

from b12x_toolchain.runtime.parallel.control import ControlChannel, RankLost, lost

REPORT_EVERY_S = 1.0  # per-rank figures (pages, replay time) reach rank 0 at most this often
TICK_EVERY_S = 1.0  # an idle server checks that every rank still answers this often


def replay_in_group(session, channel: ControlChannel, pass_name: str, values: dict):
    """A replay whose collectives fail as RankLost when a peer is gone or late."""
    try:
        return session.replay(pass_name, **values)
    except RuntimeError as exc:
        error = lost(exc, channel.rank, channel.world_size, f"a {pass_name} replay", channel.limit_s)
        if error is None:
            raise
        raise error from None


class LeaderPages:
    """Rank 0's page tables: `reserve`, the one change the engine makes to them directly, is sent on."""

    def __init__(self, pages, record):
        self._pages, self._record = pages, record

    def __getattr__(self, name):
        return getattr(self._pages, name)

    def reserve(self, slot: int, committed: int, tokens: int, shared: int = 0) -> None:
        self._pages.reserve(slot, committed, tokens, shared)
        self._record("reserve", slot, committed, tokens, shared)


class LeaderSession:
    """Rank 0's session: reads are its own, changes are also sent to every other rank."""

    def __init__(self, session, channel: ControlChannel):
        self.local, self.channel = session, channel
        self.pages = LeaderPages(session.pages, self.record)
        self.replay_seconds = 0.0
        self.control_seconds, self.control_messages = 0.0, 0  # rank 0's time sending to and hearing from the others
        self._pending: list[list] = []
        self._reported = self._ticked = 0.0
        self.rank_reports: list[dict] = []  # per rank, from the last report

    def __getattr__(self, name):
        return getattr(self.local, name)

    def record(self, *op) -> None:
        self._pending.append(list(op))

    def flush(self, *extra) -> None:
        """Send what was recorded (and `extra` operations) to every other rank."""
        ops, self._pending = self._pending + [list(op) for op in extra], []
        if ops:
            self._control(self.channel.send, ops)
            self.control_messages += 1

    def _control(self, call, *args):
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.control_seconds += time.perf_counter() - start

    def replay(self, pass_name: str, **values):
        self.flush(("replay", pass_name, values))
        start = time.perf_counter()
        out = replay_in_group(self.local, self.channel, pass_name, values)
        self.replay_seconds += time.perf_counter() - start
        return out

    def reset_slot(self, slot: int) -> None:
        self.local.reset_slot(slot)
        self.record("reset_slot", slot)

    def retire_slot(self, slot: int) -> None:
        self.local.retire_slot(slot)
        self.record("retire_slot", slot)

    def set_committed_length(self, slot: int, length: int) -> None:
        self.local.set_committed_length(slot, length)
        self.record("set_committed_length", slot, length)

    def agree(self, ok: bool) -> bool:
        """Whether every rank could make the last operation (they answer in `agree` too)."""
        self.flush(("agree",))
        return self._control(self.channel.agree, ok)

    def tick(self, idle: bool) -> None:
        """Between steps: collect each rank's figures when they are due; when idle, also send what
        is pending and check every rank still answers (a step's replays check that otherwise)."""
        now = time.monotonic()
        if now - self._reported >= REPORT_EVERY_S:
            self.flush(("report",))
            pools = sorted(self.local.pages.pool_stats())
            gathered = self._control(self.channel.gather, _report_values(self.local, self.replay_seconds))
            self.rank_reports = [{"replay_seconds": values[0], "pages_in_use": dict(zip(pools, map(int, values[1:])))}
                                 for values in gathered]
            self._reported = self._ticked = now
        elif idle and now - self._ticked >= TICK_EVERY_S:
            self.agree(True)
            self._ticked = now

    def check_pages(self) -> None:
        """Every rank's page pools have the sizes of rank 0's (check_same_pages)."""
        self.flush(("check_pages",))
        check_same_pages(self.local, self.channel)

    def stop(self) -> None:
        """Tell every other rank to stop; what was still pending matters no more."""
        self._pending = []
        stop_followers(self.channel)


def stop_followers(channel: ControlChannel) -> None:
    """Rank 0 is done (or failed before its engine ran): the other ranks' loops return. A rank
    already gone is no error."""
    try:
        channel.send([["stop"]])
    except RankLost:
        pass


def _report_values(session, replay_seconds: float) -> list[float]:
    pools = session.pages.pool_stats()
    return [replay_seconds] + [float(pools[name].in_use) for name in sorted(pools)]


class Follower:
    """What a worker rank holds: its session, the channel, its prefix snapshots (or None)."""

    def __init__(self, session, channel: ControlChannel, snapshots=None):
        self.session, self.channel, self.snapshots = session, channel, snapshots
        self.replay_seconds = 0.0
        self.last_ok = True  # whether the last operation that is agreed on succeeded here

    def replay(self, pass_name: str, values: dict) -> None:
        start = time.perf_counter()
        replay_in_group(self.session, self.channel, pass_name, values)
        self.replay_seconds += time.perf_counter() - start

    def agree(self) -> None:
        ok, self.last_ok = self.last_ok, True
        self.channel.agree(ok)

    def report(self) -> None:
        self.channel.gather(_report_values(self.session, self.replay_seconds))


# What a worker may be asked to do: operation name -> how, on a Follower.
OPERATIONS = {
    "replay": Follower.replay,
    "reset_slot": lambda f, slot: f.session.reset_slot(slot),
    "retire_slot": lambda f, slot: f.session.retire_slot(slot),
    "set_committed_length": lambda f, slot, length: f.session.set_committed_length(slot, length),
    "reserve": lambda f, *args: f.session.pages.reserve(*args),
    "agree": Follower.agree,
    "check_pages": lambda f: check_same_pages(f.session, f.channel),
    "report": Follower.report,
    "snapshot_capture": lambda f, *args: f.snapshots.capture(*args),
    "snapshot_hydrate": lambda f, *args: f.snapshots.hydrate(f, *args),
    "snapshot_load": lambda f, *args: f.snapshots.load(f, *args),
    "snapshot_drop": lambda f, names: f.snapshots.drop(names),
}


def follow(follower: Follower) -> None:
    """A worker's loop: make every operation rank 0 sends, in order, until it sends `stop`.
    Raises RankLost when rank 0 goes away or stops answering."""
    while True:
        for name, *args in follower.channel.receive():
            if name == "stop":
                return
            operation = OPERATIONS.get(name)
            if operation is None:
                raise ValueError(f"rank {follower.channel.rank}: rank 0 sent an unknown operation {name!r}; "
                                 f"expected one of {sorted(OPERATIONS)} or 'stop'")
            operation(follower, *args)


def check_same_pages(session, channel: ControlChannel) -> None:
    """Every rank's page pools have the same sizes (each sized its own from its memory): the
    scheduler on rank 0 decides for all of them. Every rank calls this after opening its session;
    from then on every rank answers within the step deadline (channel.started)."""
    pools = sorted(session.pages.pool_stats())
    counts = channel.gather([float(session.pages.pool_stats()[name].pages) for name in pools])
    if any(c != counts[0] for c in counts):
        sizes = "; ".join(f"rank {r}: " + ", ".join(f"{p} {int(n)}" for p, n in zip(pools, c))
                          for r, c in enumerate(counts))
        raise ValueError(f"the ranks' page pools differ ({sizes}); give --pages or --cache-bytes so every rank "
                         "holds the same pages")
    channel.started()


def worker_error(rank: int, exc: BaseException) -> None:
    """A worker's one error line, which reaches rank 0's log through the launcher."""
    print(f"error: rank {rank}: {exc}", file=sys.stderr, flush=True)
