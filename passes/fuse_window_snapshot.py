"""fuse_window_snapshot: window_snapshot + cache_append on one staging buffer -> one op.

Matches a snapshot copy of a layer's window history into a staging buffer followed by
the cache append of the pass's rows into the same buffer with the same history length
and page layout, with no other reader or writer of that buffer (or writer of the ring)
in between. The fused op writes the same bytes with one graph node fewer. A match the
fused op is not qualified for (history length, page layout) fails the export.
"""

from __future__ import annotations

from b12x_toolchain.runtime.ops.opset import ops
from b12x_toolchain.runtime.ops.qualify import check_fused_window
from b12x_toolchain.runtime.rewrite import PairRewrite

NAME = "fuse_window_snapshot"


def _qualified(fused: dict) -> None:
    check_fused_window(fused["history"], fused["layout"], fused["page_size"],
                       where=f"{NAME} on {fused['staging'].name}")


FUSE_WINDOW_SNAPSHOT = PairRewrite(
    name=NAME,
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
