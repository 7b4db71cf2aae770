"""fuse_window_snapshot: window_snapshot + cache_append on one staging buffer -> one op.

Matches a snapshot copy of a layer's window history into a staging buffer followed by
the cache append of the pass's rows into the same buffer with the same history length
and page layout, with no other reader or writer of that buffer (or writer of the ring)
in between. The fused op writes the same bytes with one graph node fewer. A match the
fused op is not qualified for (history length, page layout) fails the export.
"""

from __future__ import annotations

import torch

from b12x_toolchain.passes.pair_rewrite import PairRewrite
from b12x_toolchain.runtime.ops.opset import ops
from b12x_toolchain.runtime.ops.qualify import check_fused_window


def _qualified(snapshot: dict, append: dict) -> None:
    check_fused_window(snapshot["history"], snapshot["layout"], snapshot["page_size"],
                       where=f"fuse_window_snapshot on {snapshot['staging'].name}")


REWRITE = PairRewrite(
    first=ops.window_snapshot.default,
    second=ops.cache_append.default,
    fused=ops.window_snapshot_append.default,
    same=(("staging", "staging"), ("history", "history"), ("layout", "layout"), ("page_size", "page_size")),
    fused_args=(
        ("ring", ("first", "ring")),
        ("staging", ("first", "staging")),
        ("kv", ("second", "kv")),
        ("row_ids", ("first", "row_ids")),
        ("positions", ("first", "positions")),
        ("history", ("first", "history")),
        ("layout", ("first", "layout")),
        ("page_size", ("first", "page_size")),
        ("fmt", ("second", "fmt")),
    ),
    check=_qualified,
)


class FuseWindowSnapshot:
    """Pass: returns whether it changed the graph; `matches` holds the last count."""

    name = "fuse_window_snapshot"

    def __init__(self):
        self.matches = 0

    def __call__(self, gm: torch.fx.GraphModule) -> bool:
        self.matches = REWRITE.apply(gm)
        return self.matches > 0
