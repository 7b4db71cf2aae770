"""Paged caches for tests that call pass modules directly: each slot owns a run of pages.

Slot s holds pages s * pages_per_slot .. (s + 1) * pages_per_slot - 1 of every pool, so
a module called outside a session sees the contiguous layout expressed as pages.
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.package.contract import CachePages
from b12x_toolchain.runtime.package.kinds import KINDS


def pool_widths(specs) -> dict[str, int]:
    return {s.info.page.pool: s.info.page.pages_per_slot for s in specs
            if s.info is not None and isinstance(s.info.page, CachePages)}


def symbols(specs, slots: int, rows: int | None = None) -> dict:
    """Shape symbols for `slots` slots (as given: include any scratch slot yourself)."""
    out = {"slots": slots, **{pool: slots * width for pool, width in pool_widths(specs).items()}}
    return out if rows is None else {**out, "rows": rows}


def block_tables(specs, row_ids) -> dict[str, torch.Tensor]:
    """Each block-table input of `specs` for the rows' slots: int32 [rows, pages_per_slot]."""
    rows = torch.as_tensor(row_ids).long()
    widths = pool_widths(specs)
    out = {}
    for spec in specs:
        pool = KINDS[spec.info.kind].pool if spec.role == "input" and spec.info is not None else None
        if pool is not None:
            width = widths[pool]
            assert spec.shape[1] == width
            out[spec.name] = (rows[:, None] * width + torch.arange(width)).to(torch.int32)
    return out
