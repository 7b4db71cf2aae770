"""How a pass reads and writes caches: through staging (verify, draft) or directly (prefill).

Both give the layer compute the same things — decoded window rows [R, S, D], the
previous rows of a compressor's state ring, this pass's compressed entries as a later
read returns them — so the layers are written once. Every cache access is a `b12x` op.

A state ring keeps the raw [kv | gate] rows of the last `span` committed positions at row
`pos % span`: the last `span - 1` are what the next pass's first closing group can still
need, and every pass writes all `span`, so the ring's bytes do not depend on the pass.
"""

from __future__ import annotations

import torch

from b12x_toolchain.exporter.model import buffer_names as names
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.ops.opset import ops

STATE_FORMAT = "fp32"


class StagedIO:
    """Verify/draft: snapshot the window history into staging, append, read back.

    Persistent caches are only read; what commit will make persistent goes to staging.
    """

    def __init__(self, d: Dims, caches: dict, staging: dict, row_ids, positions, pass_name: str, block_tables):
        self.d, self.caches, self.staging, self.block_tables = d, caches, staging, block_tables
        self.row_ids, self.positions, self.pass_name = row_ids, positions, pass_name

    def window(self, owner: str, kv: torch.Tensor) -> torch.Tensor:
        """Keys [R, history + T, D]: the whole snapshot (commit copies from it), then kv."""
        d = self.d
        stage = self.staging[names.staging(self.pass_name, names.window(owner))]
        ops.window_snapshot(self.caches[names.cache(names.window(owner))], stage, self.row_ids, self.positions,
                            d.history, d.layout, d.page_size)
        ops.cache_append(stage, kv, d.history, d.layout, d.page_size, d.window_format)
        return ops.window_read(stage, d.history + kv.shape[1], d.head_dim, d.window_format)

    def key_positions(self, width: int) -> torch.Tensor:
        """[R, history + width]: the positions of the keys `window` returns."""
        return _key_positions(self.positions, self.d.history, width)

    def owned(self, name: str) -> list[torch.Tensor]:
        """The buffers behind cache `name`: the cache, then its staging."""
        return [self.caches[names.cache(name)], self.staging[names.staging(self.pass_name, name)]]

    def state(self, name: str, span: int, rows: torch.Tensor) -> torch.Tensor:
        prev = ops.gather_rows(self.caches[names.cache(name)], self.row_ids, _before(self.positions, span - 1),
                               rows.shape[-1], STATE_FORMAT)
        ops.stage_rows(self.staging[names.staging(self.pass_name, name)], rows, STATE_FORMAT)
        return prev

    def entries(self, name: str, entries: torch.Tensor, ratio: int, fmt: str, block_table) -> torch.Tensor:
        stage = self.staging[names.staging(self.pass_name, name)]
        ops.stage_rows(stage, entries, fmt)
        return ops.read_rows(stage, entries.shape[-1], fmt)[:, : entries.shape[1]]

    def rows(self, stage: str, cache: str, rows: torch.Tensor, fmt: str, last_only: bool) -> None:
        """Per-position rows (MTP context, streams); commit picks what it keeps."""
        ops.stage_rows(self.staging[names.staging(self.pass_name, stage)], rows, fmt)


class DirectIO:
    """Prefill and decode: read history from the persistent caches, then write the valid rows there."""

    def __init__(self, d: Dims, caches: dict, row_ids, positions, lengths, block_tables, width: int):
        self.d, self.caches, self.block_tables = d, caches, block_tables
        self.row_ids, self.positions = row_ids, positions
        self.offsets = torch.arange(width, device=positions.device)
        self.pos = positions.long()[:, None] + self.offsets
        self.valid = self.offsets[None, :] < lengths.long()[:, None]
        self.end = positions.long() + lengths.long()
        self.seen = min(d.history, d.window - 1)  # ring rows a pass reads before its own

    def window(self, owner: str, kv: torch.Tensor) -> torch.Tensor:
        """Keys: the ring rows the first query can still see (window - 1 of them, no more than
        the ring holds; older rows are outside every query's window), then kv."""
        d = self.d
        ring = self.caches[names.cache(names.window(owner))]
        history = ops.gather_rows(ring, self.row_ids, _before(self.positions, self.seen), d.head_dim, d.window_format)
        new = ops.round_trip(kv, d.window_format)
        ops.write_rows(ring, kv, self.row_ids, self.pos % d.history, self.valid, d.window_format)
        return torch.cat([history, new], dim=1)

    def key_positions(self, width: int) -> torch.Tensor:
        """[R, seen + width]: the positions of the keys `window` returns."""
        return _key_positions(self.positions, self.seen, width)

    def owned(self, name: str) -> list[torch.Tensor]:
        """The buffers behind cache `name`."""
        return [self.caches[names.cache(name)]]

    def state(self, name: str, span: int, rows: torch.Tensor) -> torch.Tensor:
        cache = self.caches[names.cache(name)]
        prev = ops.gather_rows(cache, self.row_ids, _before(self.positions, span - 1), rows.shape[-1], STATE_FORMAT)
        # The last `span` positions, the ring's every row: a later pass reads only span - 1 of
        # them, but a ring left as decoding leaves it holds the same bytes after any pass.
        keep = self.valid & (self.pos >= self.end[:, None] - span)
        ops.write_rows(cache, rows, self.row_ids, self.pos % span, keep, STATE_FORMAT)
        return prev

    def entries(self, name: str, entries: torch.Tensor, ratio: int, fmt: str, block_table) -> torch.Tensor:
        cache = self.caches[names.cache(name)]
        closes = ((self.pos + 1) % ratio == 0) & self.valid
        per_page = cache.shape[1] // get_format(fmt).row_bytes(entries.shape[-1])
        ops.write_slots(cache, entries, slot_mapping(block_table, self.pos // ratio, closes, per_page), fmt)
        return ops.round_trip(entries, fmt)

    def rows(self, stage: str, cache: str, rows: torch.Tensor, fmt: str, last_only: bool) -> None:
        """A ring row per position, or (last_only) one row per slot: the last position's."""
        buffer = self.caches[names.cache(cache)]
        if last_only:
            ops.write_rows(buffer, rows, self.row_ids, torch.zeros_like(self.pos),
                           self.valid & (self.pos == self.end[:, None] - 1), fmt)
        else:
            ops.write_rows(buffer, rows, self.row_ids, self.pos % buffer.shape[1], self.valid, fmt)


def slot_mapping(block_table: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, per_page: int) -> torch.Tensor:
    """[R, T] entry slot (page * per_page + record) of each entry id through its row's block
    table; -1 (write_slots skips it) where not valid or where the row has no page there."""
    column = (ids // per_page).clamp(0, block_table.shape[1] - 1)
    page = block_table.long().gather(1, column)
    return torch.where(valid & (page >= 0), page * per_page + ids % per_page, -1)


def _key_positions(positions: torch.Tensor, history: int, width: int) -> torch.Tensor:
    """[R, history + width]: the `history` positions before each row's first, then the pass's own."""
    return positions.long()[:, None] + torch.arange(-history, width, device=positions.device)


def _before(positions: torch.Tensor, count: int) -> torch.Tensor:
    """Absolute positions of the `count` rows just before each row's first position."""
    return _key_positions(positions, count, 0)

