"""inline_references: the op set's pure ops become calls of their torch references.

Ops that only compute from their inputs, with static shapes, are opaque to Inductor as ops:
on the CPU each would run its reference step by step. As calls of the references Inductor
traces and fuses them (hc_sinkhorn as its written-out loop).

sparse_attention stays an op, whatever its form. Its reference sums over keys in a fixed
order (runtime/ops/fixed_order.py: blocks of positions anchored at absolute positions, then
block after block), the order that makes a token's result the same in a decode, a verify row
or a prefill. Traced by Inductor, those sums are regrouped by the shape of the pass: measured
on the small test recipe, compiled decode then differed from compiled verify's first row by
1e-6 in the logits, where kept as the op they agree to the bit. Kept, the compiled decode
replay costs about a third more time there (11 ms against 8.4 ms, still well under the
uncompiled 26 ms); exact speculative decoding is worth it.
"""

from __future__ import annotations

from b12x_toolchain.runtime.ops import opset
from b12x_toolchain.runtime.ops.mhc_ops import sinkhorn_unfused
from b12x_toolchain.runtime.ops.opset import ops
from b12x_toolchain.runtime.rewrite import NodeRewrite, Rule

INLINE_REFERENCES = NodeRewrite("inline_references", (
    Rule(ops.round_trip.default, to=opset.round_trip),
    Rule(ops.gather_rows.default, to=opset.gather_rows),
    Rule(ops.window_read.default, to=opset.window_read),
    Rule(ops.read_rows.default, to=opset.read_rows),
    Rule(ops.hc_sinkhorn.default, to=sinkhorn_unfused),
))
