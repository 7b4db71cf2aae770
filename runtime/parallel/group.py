"""The process group a rank's graphs run their collectives in, checked before any replay.

Exported graphs call torch's functional collectives (`_c10d_functional.*`) with the
group's name and size baked in: the default group is named "0" in every process that
initialised torch.distributed, so a package exported on the fake backend replays on gloo
or NCCL once this process's default group has the package's world size and this rank's
number. A name the process does not know is registered for the default group; a group
of another size, a missing group, a wrong rank or a peer that does not answer is refused
here, naming the rank and the group, rather than failing or hanging inside a replay.
"""

from __future__ import annotations

import re
from datetime import timedelta

from b12x_toolchain.runtime.errors import PackageError

NAMESPACE = "_c10d_functional"
# What a graph may call of it: fixed-shape collectives (a CUDA graph captures them) and their wait.
COLLECTIVES = ("all_reduce", "all_gather_into_tensor")
ALLOWED = COLLECTIVES + ("wait_tensor",)
ALLOWED_TARGETS = {f"torch.ops.{NAMESPACE}.{name}.default" for name in ALLOWED}


def _op(node) -> str | None:
    """The collective's name if `node` calls one of `_c10d_functional`, else None."""
    target = getattr(node, "target", None)
    if getattr(target, "namespace", None) != NAMESPACE:
        return None
    return target.name().split("::")[1].split(".")[0]


def is_allowed(target) -> bool:
    return getattr(target, "namespace", None) == NAMESPACE and target.name().split("::")[1].split(".")[0] in ALLOWED


def collective_counts(graph) -> dict[str, int]:
    """How many of each collective the graph issues (waits not counted)."""
    counts = {}
    for node in graph.nodes:
        op = _op(node)
        if op in COLLECTIVES:
            counts[op] = counts.get(op, 0) + 1
    return counts


def _group_args(node) -> tuple[str, int | None]:
    """(group name, group size or None) of a collective node."""
    if _op(node) == "all_reduce":  # (input, reduce_op, group_name)
        return node.args[2], None
    return node.args[2], node.args[1]  # all_gather_into_tensor: (input, group_size, group_name)


def bind_group(programs: dict, rank: int, world_size: int, describe: str, peer_timeout: float | None = None) -> None:
    """Check this process's default group against the package, and make every group name the
    graphs call resolve to it. `programs`: pass name -> ExportedProgram of this rank."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group, _resolve_process_group

    where = f"rank {rank} of a package for {describe}"
    if not (dist.is_available() and dist.is_initialized()):
        raise PackageError(f"{where}: no process group is initialised in this process; call "
                           "torch.distributed.init_process_group (or launch with torchrun / b12x run --nproc) first")
    if dist.get_world_size() != world_size:
        raise PackageError(f"{where}: this process's default group has world size {dist.get_world_size()}; "
                           f"the package was exported for world size {world_size}")
    if dist.get_rank() != rank:
        raise PackageError(f"{where}: this process is rank {dist.get_rank()} of its default group, not rank {rank}")
    default = dist.group.WORLD
    for pass_name, program in programs.items():
        for node in program.graph.nodes:
            if _op(node) not in COLLECTIVES:
                continue
            name, size = _group_args(node)
            if size is not None and size != world_size:
                raise PackageError(f"{where}: graph {pass_name} calls {_op(node)} over {size} ranks on group {name!r}; "
                                   f"expected {world_size}")
            try:
                group = _resolve_process_group(name)
            except RuntimeError:
                _register_process_group(name, default)
                continue
            if group.size() != world_size:
                raise PackageError(f"{where}: group {name!r}, which graph {pass_name} calls, has {group.size()} "
                                   f"ranks in this process; expected {world_size}")
    if peer_timeout is not None:
        check_peers(rank, world_size, peer_timeout)


def check_peers(rank: int, world_size: int, timeout: float) -> None:
    """Every rank answers within `timeout` seconds, or the missing ones are named."""
    import torch.distributed as dist

    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        else:
            dist.barrier()
    except RuntimeError as exc:
        # gloo names the ranks that did not reach the barrier; a peer that went away closes its connection.
        named = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(exc))
        who = f"rank {named.group(1).strip()}" if named else "a peer (its connection closed)"
        raise PackageError(f"rank {rank} of world size {world_size}: {who} did not answer within {timeout:g} s; "
                           "start every rank, each loading the same package") from None
