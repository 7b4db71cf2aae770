"""A graph rewrite and the result it returns, in the manner of torch.fx's pass result.

A rewrite keeps no state between runs: `rewrite` changes the graph in place and returns
how many matches it rewrote, and calling the rewrite returns that count with the node
counts around it. The result is what the manifest records and what a recipe's expected
match count is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx


@dataclass(frozen=True)
class RewriteResult:
    name: str
    changed: bool
    matches: int
    nodes_before: int  # call_function nodes: what a replay dispatches
    nodes_after: int

    def to_json(self) -> dict:
        return {"matches": self.matches, "nodes_before": self.nodes_before, "nodes_after": self.nodes_after}


def count_nodes(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


class Rewrite:
    """Subclasses set `name` and implement `rewrite`."""

    name: str

    def rewrite(self, gm: torch.fx.GraphModule) -> int:
        raise NotImplementedError

    def __call__(self, gm: torch.fx.GraphModule) -> RewriteResult:
        nodes_before = count_nodes(gm)
        matches = self.rewrite(gm)
        nodes_after = count_nodes(gm)
        # A rewrite that only removes nodes (layer markers) changes the graph without a match.
        changed = matches > 0 or nodes_after != nodes_before
        return RewriteResult(self.name, changed, matches, nodes_before, nodes_after)
