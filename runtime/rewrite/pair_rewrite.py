"""Fuse two effectful ops into one, described as data.

A `PairRewrite` is a rewrite: it names the first and second op, which arguments must be the
same node or constant for the pair to match, and where each of the fused op's arguments
(by schema name) is taken from.
The fused node replaces the second op in program order; that is legal only when nothing
that depends on the first op (a reader or writer of what it touches) runs before the
second one, which the dependency graph answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.fx

from b12x_toolchain.runtime.rewrite.dependency import dependency_graph, order
from b12x_toolchain.runtime.rewrite.graph_rewrite import Rewrite
from b12x_toolchain.runtime.rewrite.schema_args import named_args


@dataclass(frozen=True)
class PairRewrite(Rewrite):
    name: str
    first: object  # OpOverload
    second: object
    fused: object
    same: tuple[tuple[str, str], ...]  # (first's argument, second's argument) that must be identical
    fused_args: tuple[tuple[str, str], ...]  # fused argument -> ("first" | "second", argument name)
    check: Callable[[dict], None] | None = None  # on the fused op's arguments; raises on a match it must refuse

    def candidates(self, graph: torch.fx.Graph):
        """(first, second) pairs: each second op paired with the nearest earlier linked first op."""
        pending = []
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            if node.target == self.first:
                pending.append(node)
            elif node.target == self.second:
                args = named_args(node)
                for first in reversed(pending):
                    fargs = named_args(first)
                    if all(fargs[a] is args[b] or fargs[a] == args[b] for a, b in self.same):
                        pending.remove(first)
                        yield first, node
                        break

    def _fused_op_args(self, first: torch.fx.Node, second: torch.fx.Node) -> dict:
        """The fused op's arguments by schema name, taken from the pair's."""
        source = {"first": named_args(first), "second": named_args(second)}
        return {fused_name: source[side][name] for fused_name, (side, name) in self.fused_args}

    def rewrite(self, gm: torch.fx.GraphModule) -> int:
        graph = gm.graph
        pairs = list(self.candidates(graph))
        if not pairs:
            return 0
        dag = dependency_graph(graph)
        legal = [
            (first, second) for first, second in pairs
            # Moving the first op down to the second is legal only if nothing that
            # depends on its effect (reader/writer of what it touches) runs in between.
            if not any(s is not second and order(dag, s) < order(dag, second) for s in dag.successors(first))
        ]
        fused = [self._fused_op_args(first, second) for first, second in legal]
        if self.check is not None:  # refuse before touching the graph: no half-rewritten result
            for named in fused:
                self.check(named)
        for (first, second), named in zip(legal, fused):
            args = tuple(named[a.name] for a in self.fused._schema.arguments)
            with graph.inserting_before(second):
                node = graph.call_function(self.fused, args)
            node.meta.update(second.meta)
            graph.erase_node(second)
            graph.erase_node(first)
        gm.recompile()
        return len(legal)
