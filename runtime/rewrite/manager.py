"""Run passes over a graph, checking invariants after each one.

A pass is a callable taking a GraphModule, changing it in place and returning its
PassResult (a RewritePass). A failure — an exception or a broken invariant — names the
pass and the graph it ran on.
"""

from __future__ import annotations

import torch.fx

from b12x_toolchain.runtime.rewrite.invariants import check_invariants, signature
from b12x_toolchain.runtime.rewrite.rewrite_pass import PassResult


class PassError(RuntimeError):
    pass


def run_passes(gm: torch.fx.GraphModule, passes: list, graph_name: str) -> list[PassResult]:
    results = []
    for rewrite in passes:
        before = signature(gm.graph)
        try:
            result = rewrite(gm)
        except Exception as exc:
            raise PassError(f"pass {rewrite.name} failed on the {graph_name} graph: {exc}") from exc
        problems = check_invariants(gm, before)
        if problems:
            raise PassError(f"pass {rewrite.name} broke the {graph_name} graph: " + "; ".join(problems))
        results.append(result)
    return results
