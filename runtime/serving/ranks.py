"""Serving a parallel package: rank 0 runs the engine (open_engine with a channel), every other
rank runs `follow_leader`, the one worker loop of `b12x run --nproc` and `b12x serve --nproc`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from b12x_toolchain.runtime.serving.options import EngineOptions, open_session, rank_prefix_dir

if TYPE_CHECKING:  # torch, which the command line imports only when a command runs
    from b12x_toolchain.runtime.parallel.control import ControlChannel

DEFAULT_STEP_DEADLINE_S = 30.0  # a rank that does not answer within this is lost
DEFAULT_JOIN_TIMEOUT_S = 120.0  # every rank must have started and loaded within this


@dataclass(frozen=True)
class RankContext:
    """What rank 0 of a parallel package serves with: its rank, its channel to the others, and how
    long loading may wait for them."""

    rank: int
    channel: "ControlChannel"
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S


def follow_leader(package, options: EngineOptions, channel: "ControlChannel") -> None:
    """Open the session rank 0 opens (the same options), then make every change rank 0 sends
    (its first: comparing the page pools) until it sends stop. Raises RankLost when rank 0 goes
    away or stops answering."""
    from b12x_toolchain.runtime.parallel.lockstep import Follower, follow

    session = open_session(package, options)
    snapshots = _snapshots(package, session, options, channel.rank)
    try:
        follow(Follower(session, channel, snapshots))
    finally:
        if snapshots is not None:
            snapshots.close()


def _snapshots(package, session, options: EngineOptions, rank: int):
    """This rank's twins of rank 0's prefix snapshots, when rank 0 keeps any (same options, same package)."""
    from b12x_toolchain.runtime.parallel.lockstep_prefix import FollowerSnapshots
    from b12x_toolchain.runtime.prefix.l2 import L2Store
    from b12x_toolchain.runtime.prefix.snapshot import LayoutError

    caps = package.manifest.model.capabilities or {}
    if options.prefix_cache_bytes == 0 or caps.get("supports_prefix_snapshot") is not True:
        return None
    directory = rank_prefix_dir(options.prefix_cache_dir, rank)
    l2 = L2Store(directory, options.prefix_cache_bytes) if directory is not None else None
    try:
        return FollowerSnapshots(package, session, l2)
    except LayoutError:  # rank 0's cache is off for the same reason
        if l2 is not None:
            l2.close()
        return None


def between_steps(session, idle: bool) -> None:
    """Rank 0, between two steps: per-rank figures when due and, when idle, a check that every
    rank still answers. Nothing for a session of one device."""
    tick = getattr(session, "tick", None)
    if tick is not None:
        tick(idle)
