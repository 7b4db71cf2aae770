"""What the layers read and write while training: whole sequences from position 0, in float.

The passes reach caches through an IO object (exporter/model/cache_io.py). Training runs
every position of a sequence as one chunk from position 0, so nothing is read back from a
cache: `SequenceIO` hands the layers their own rows as a cache read would return them
(through the format's round trip, see training_ops.py), without writing anything.
`DraftBlockIO` gives the draft stages, for each anchor row, the context rows the target
produced before it — what the draft pass reads from its window rings at replay.
"""

from __future__ import annotations

import torch

from b12x_toolchain.exporter.model import buffer_names as names
from b12x_toolchain.exporter.model.buffers import owned_caches
from b12x_toolchain.exporter.model.layers import ENTRY_POOL, INDEX_POOL
from b12x_toolchain.exporter.train.training_ops import straight_through_round_trip as _round_trip
from b12x_toolchain.runtime.package.kinds import KINDS


class SequenceIO:
    """A prefill of whole sequences [R, T] from position 0 (see the module's docstring)."""

    def __init__(self, d, rows: int, width: int, device="cpu"):
        self.d = d
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.pos = torch.arange(width, device=device).expand(rows, -1)
        # Compressed entries and index keys are all this pass's own (`entry_rows` takes an id
        # at or past the committed length from `new`): the paged caches are never read.
        self.block_tables = {pool: torch.zeros(rows, 1, dtype=torch.int32, device=device)
                             for pool in (ENTRY_POOL, INDEX_POOL)}

    def window(self, owner: str, kv: torch.Tensor) -> torch.Tensor:
        return _round_trip(kv, self.d.window_format)

    def key_positions(self, width: int) -> torch.Tensor:
        return self.pos[:, :width]

    def state(self, name: str, span: int, rows: torch.Tensor) -> torch.Tensor:
        """Nothing comes before position 0: the rows before are zeros (their positions are negative)."""
        return rows.new_zeros(rows.shape[0], span - 1, rows.shape[-1])

    def entries(self, name: str, entries: torch.Tensor, ratio: int, fmt: str, block_table) -> torch.Tensor:
        return _round_trip(entries, fmt)

    def rows(self, stage: str, cache: str, rows: torch.Tensor, fmt: str, last_only: bool) -> None:
        pass


def empty_caches(d, device="cpu") -> dict:
    """A one-record stand-in for each paged cache the layers name (never read, see SequenceIO)."""
    return {names.cache(c.name): torch.zeros(1, c.row_bytes, dtype=torch.uint8, device=device)
            for i in range(d.layers) for c in owned_caches(d, i) if KINDS[c.kind].pool is not None}


class DraftBlockIO:
    """Draft blocks [anchor, noise...] at `positions` [B], each over the `history` context rows
    before its anchor: `context[s]` [B, history, D] for stage s (zeros before position 0)."""

    def __init__(self, d, positions: torch.Tensor, context: list[torch.Tensor]):
        self.d, self.positions = d, positions
        self.context = {names.stage(s): rows for s, rows in enumerate(context)}

    def window(self, owner: str, kv: torch.Tensor) -> torch.Tensor:
        fmt = self.d.window_format
        return torch.cat([_round_trip(self.context[owner], fmt), _round_trip(kv, fmt)], dim=1)

    def key_positions(self, width: int) -> torch.Tensor:
        return self.positions.long()[:, None] + torch.arange(-self.d.history, width, device=self.positions.device)
