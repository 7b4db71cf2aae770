"""The rewrite kit: every graph rewrite (the fusion, the Inductor lowering, layer copying) is a
`Rewrite` that returns a RewriteResult, finds op arguments by schema name, and runs through
`run_rewrites`, which checks the graph's invariants after each rewrite and names the rewrite
that broke one. It is part of the runtime, which lowers graphs with it, and the rewrites in
`passes` build on it; it imports nothing of `passes` or `exporter`.
"""

from b12x_toolchain.runtime.rewrite.graph_rewrite import Rewrite, RewriteResult, count_nodes
from b12x_toolchain.runtime.rewrite.manager import RewriteError, run_rewrites
from b12x_toolchain.runtime.rewrite.node_rewrite import NodeRewrite, Rule
from b12x_toolchain.runtime.rewrite.pair_rewrite import PairRewrite
from b12x_toolchain.runtime.rewrite.schema_args import named_args, replace_args

__all__ = ["NodeRewrite", "PairRewrite", "Rewrite", "RewriteError", "RewriteResult", "Rule", "count_nodes",
           "named_args", "replace_args", "run_rewrites"]
