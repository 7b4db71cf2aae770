"""Rewrite single op nodes by a table of rules, described as data.

A `Rule` names the op it applies to, a condition on the node's arguments (by schema name)
and what becomes of the node: another target taking the same arguments (`to`), or a
function that edits the node in place (`edit`). A `NodeRewrite` is a rewrite applying its
rules to every node of their ops whose condition holds; its matches are the nodes it
rewrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.fx

from b12x_toolchain.runtime.rewrite.graph_rewrite import Rewrite
from b12x_toolchain.runtime.rewrite.schema_args import named_args


def always(args: dict) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    op: object  # OpOverload
    to: Callable | None = None  # the new target, called with the same arguments
    edit: Callable[[torch.fx.Graph, torch.fx.Node, dict], None] | None = None  # (graph, node, named args)
    when: Callable[[dict], bool] = always  # on the node's arguments by name

    def __post_init__(self):
        if (self.to is None) == (self.edit is None):
            raise ValueError(f"a rule for {self.op} either retargets the node (to) or edits it (edit)")


@dataclass(frozen=True)
class NodeRewrite(Rewrite):
    name: str
    rules: tuple[Rule, ...]

    def rewrite(self, gm: torch.fx.GraphModule) -> int:
        by_op = {rule.op: rule for rule in self.rules}
        matches = 0
        for node in list(gm.graph.nodes):
            rule = by_op.get(node.target) if node.op == "call_function" else None
            if rule is None:
                continue
            args = named_args(node)
            if not rule.when(args):
                continue
            if rule.to is not None:
                node.target = rule.to
            else:
                rule.edit(gm.graph, node, args)
            matches += 1
        gm.recompile()
        return matches
