"""Run a named pipeline of passes over a graph, checking invariants after each one.

A pass is a callable taking a GraphModule and returning whether it changed it; passes
that count matches expose `matches`. A failure — an exception or a broken invariant —
names the pass and the graph it ran on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from b12x_toolchain.passes.fuse_window_snapshot import FuseWindowSnapshot
from b12x_toolchain.passes.kit.invariants import check_invariants, signature

REGISTRY = {FuseWindowSnapshot.name: FuseWindowSnapshot}


class PassError(RuntimeError):
    pass


@dataclass(frozen=True)
class PassRecord:
    name: str
    changed: bool
    matches: int
    nodes_before: int
    nodes_after: int

    def to_json(self) -> dict:
        return {"matches": self.matches, "nodes_before": self.nodes_before, "nodes_after": self.nodes_after}


def count_nodes(gm: torch.fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function")


def build_pipeline(names: list[str]) -> list:
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise PassError(f"unknown pass {unknown[0]!r}; known passes: {sorted(REGISTRY)}")
    return [REGISTRY[n]() for n in names]


def run_pipeline(gm: torch.fx.GraphModule, pipeline: list, graph_name: str) -> list[PassRecord]:
    records = []
    for p in pipeline:
        before, nodes_before = signature(gm.graph), count_nodes(gm)
        try:
            changed = bool(p(gm))
        except Exception as exc:
            raise PassError(f"pass {p.name} failed on the {graph_name} graph: {exc}") from exc
        problems = check_invariants(gm, before)
        if problems:
            raise PassError(f"pass {p.name} broke the {graph_name} graph: " + "; ".join(problems))
        records.append(PassRecord(p.name, changed, getattr(p, "matches", 0), nodes_before, count_nodes(gm)))
    return records
