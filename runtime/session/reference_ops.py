"""inline_references: the op set's pure ops become calls of their torch references.

Ops that only compute from their inputs, with static shapes (where the condition on the
node's arguments holds), are opaque to Inductor as ops: on the CPU each would run its
reference step by step. As calls of the references Inductor traces and fuses them
(hc_sinkhorn as its written-out loop).
"""

from __future__ import annotations

from b12x_toolchain.runtime.ops import opset, sparse_ops
from b12x_toolchain.runtime.ops.mhc_ops import sinkhorn_unfused
from b12x_toolchain.runtime.ops.opset import ops
from b12x_toolchain.runtime.rewrite import NodeRewrite, Rule


def static_attention(args: dict) -> bool:
    """Window only (no entry cache) or the indexer's listed ids: static shapes. Every visible
    entry (no indices) is as many as the context holds, so that form stays the op."""
    return args["entry_cache"] is None or args["indices"] is not None


INLINE_REFERENCES = NodeRewrite("inline_references", (
    Rule(ops.round_trip.default, to=opset.round_trip),
    Rule(ops.gather_rows.default, to=opset.gather_rows),
    Rule(ops.window_read.default, to=opset.window_read),
    Rule(ops.read_rows.default, to=opset.read_rows),
    Rule(ops.hc_sinkhorn.default, to=sinkhorn_unfused),
    Rule(ops.sparse_attention.default, to=sparse_ops.sparse_attention, when=static_attention),
))
