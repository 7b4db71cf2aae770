"""Serving a parallel package: rank 0 runs the engine (open_engine with a channel), every other
rank runs `follow_leader`, the one worker loop of `b12x run --nproc` and `b12x serve --nproc`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from b12x_toolchain.runtime.serving.options import EngineOptions, open_prefix_cache, open_session

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
    from b12x_toolchain.runtime.parallel.lockstep_prefix import FollowerSnapshots

    session = open_session(package, options)
    # The prefix cache rank 0 opens with the same options: on exactly when rank 0's is; its codec
    # and this rank's L2 keep the twins (its own choices go unused: rank 0 makes them).
    cache = open_prefix_cache(package, options, channel.rank)
    snapshots = FollowerSnapshots(session, cache.codec, cache.l2) if cache is not None and cache.enabled else None
    try:
        follow(Follower(session, channel, snapshots))
    finally:
        if snapshots is not None:
            snapshots.drop(list(snapshots.twins))
        if cache is not None:
            cache.close()


def between_steps(session, idle: bool) -> None:
    """Rank 0, between two steps: per-rank figures when due and, when idle, a check that every
    rank still answers. Nothing for a session of one device."""
    tick = getattr(session, "tick", None)
    if tick is not None:
        tick(idle)
