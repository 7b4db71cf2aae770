"""The rewrite kit: every graph rewrite (the fusion, the Inductor lowering, layer copying) is a
pass that returns a PassResult, finds op arguments by schema name, and runs through
`run_passes`, which checks the graph's invariants after each pass and names the pass that
broke one. The runtime may import this sub-package (and nothing else of `passes`); it
imports nothing of `passes` outside it.
"""

from b12x_toolchain.runtime.rewrite.manager import PassError, run_passes
from b12x_toolchain.runtime.rewrite.node_rewrite import NodeRewrite, Rule
from b12x_toolchain.runtime.rewrite.pair_rewrite import PairRewrite
from b12x_toolchain.runtime.rewrite.rewrite_pass import PassResult, RewritePass, count_nodes
from b12x_toolchain.runtime.rewrite.schema_args import named_args, replace_args

__all__ = ["NodeRewrite", "PairRewrite", "PassError", "PassResult", "RewritePass", "Rule", "count_nodes",
           "named_args", "replace_args", "run_passes"]
