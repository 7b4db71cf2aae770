"""bind_group on graphs that name groups this process may not know: an unknown name is
registered for the default group, a name bound to a group of another size is refused."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.fx

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.parallel.group import bind_group
from ranks import on_ranks


def program(group_name: str, size: int | None = None):
    """A graph holding one collective on `group_name` (all-gather over `size` ranks, else all-reduce)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    c10d = torch.ops._c10d_functional
    if size is None:
        out = graph.call_function(c10d.all_reduce.default, (x, "sum", group_name))
    else:
        out = graph.call_function(c10d.all_gather_into_tensor.default, (x, size, group_name))
    graph.output(graph.call_function(c10d.wait_tensor.default, (out,)))
    return SimpleNamespace(graph=graph)


def _bind(rank):
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    bind_group({"verify": program("b12x-test-unknown")}, rank, 2, "tensor 2")
    # The name now resolves to the default group: a collective on it sums over both ranks.
    total = funcol.all_reduce(torch.ones(1), "sum", "b12x-test-unknown").wait().item()
    alone = dist.new_group([rank], use_local_synchronization=True)  # each rank: a group of one
    refused = []
    for prog in (program(alone.group_name), program("0", size=4)):
        try:
            bind_group({"verify": prog}, rank, 2, "tensor 2")
        except PackageError as exc:
            refused.append(str(exc))
    return total, refused


def test_unknown_group_names_are_registered_and_mismatched_groups_refused():
    for rank, (total, refused) in enumerate(on_ranks(_bind, 2)):
        assert total == 2.0
        assert len(refused) == 2
        assert f"rank {rank} of a package for tensor 2: group" in refused[0] and "has 1 ranks in this process; " \
            "expected 2" in refused[0]
        assert "graph verify calls all_gather_into_tensor over 4 ranks on group '0'; expected 2" in refused[1]
