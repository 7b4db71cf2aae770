"""Run rewrites over a graph, checking invariants after each one.

A rewrite is a callable taking a GraphModule, changing it in place and returning its
RewriteResult (a `Rewrite`). A failure — an exception or a broken invariant — names the
rewrite and the graph it ran on.
"""

from __future__ import annotations

import torch.fx

from b12x_toolchain.runtime.rewrite.graph_rewrite import RewriteResult
from b12x_toolchain.runtime.rewrite.invariants import check_invariants, signature


class RewriteError(RuntimeError):
    pass


def run_rewrites(gm: torch.fx.GraphModule, rewrites: list, graph_name: str) -> list[RewriteResult]:
    results = []
    for rewrite in rewrites:
        before = signature(gm.graph)
        try:
            result = rewrite(gm)
        except Exception as exc:
            raise RewriteError(f"rewrite {rewrite.name} failed on the {graph_name} graph: {exc}") from exc
        problems = check_invariants(gm, before)
        if problems:
            raise RewriteError(f"rewrite {rewrite.name} broke the {graph_name} graph: " + "; ".join(problems))
        results.append(result)
    return results
