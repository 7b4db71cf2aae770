"""How a pass reads and writes caches: through staging (verify, draft) or directly (prefill).

Both return the same thing to the model: decoded key rows [R, S, D] and their absolute
positions, so the layer compute is written once. Every cache access is a `b12x` op.
"""

from __future__ import annotations

import torch

from b12x.exporter.dims import Dims

ops = torch.ops.b12x


class StagedIO:
    """Verify/draft: snapshot the window history into staging, append, read back.

    Persistent caches are only read; what commit will make persistent goes to staging.
    """

    def __init__(self, d: Dims, caches: dict, staging: dict, row_ids, positions, pass_name: str):
        self.d, self.caches, self.staging = d, caches, staging
        self.row_ids, self.positions, self.pass_name = row_ids, positions, pass_name

    def window(self, owner: str, kv: torch.Tensor) -> torch.Tensor:
        d = self.d
        stage = self.staging[f"staging.{self.pass_name}.{owner}.window"]
        ops.window_snapshot(self.caches[f"cache.{owner}.window"], stage, self.row_ids, self.positions,
                            d.history, d.layout, d.page_size)
        ops.cache_append(stage, kv, d.history, d.layout, d.page_size, d.window_format)
        return ops.window_read(stage, d.history + kv.shape[1], d.head_dim, d.window_format)

    def open_group(self, layer: int, ratio: int, rows: torch.Tensor) -> torch.Tensor:
        state = self.caches[f"cache.layer{layer}.state"]
        prev = ops.gather_rows(state, self.row_ids, _before(self.positions, ratio - 1), 2 * self.d.head_dim,
                               self.d.state_format)
        ops.stage_rows(self.staging[f"staging.verify.layer{layer}.state"], rows, self.d.state_format)
        return prev

    def compressed(self, layer: int, entries: torch.Tensor, ratio: int) -> torch.Tensor:
        stage = self.staging[f"staging.verify.layer{layer}.compressed"]
        ops.stage_rows(stage, entries, self.d.compressed_format)
        return ops.read_rows(stage, self.d.head_dim, self.d.compressed_format)[:, : entries.shape[1]]

    def context(self, stage_index: int, rows: torch.Tensor) -> None:
        ops.stage_rows(self.staging[f"staging.verify.draft{stage_index}.context"], rows, self.d.window_format)


class DirectIO:
    """Prefill: read history from the persistent caches, then write the valid rows there."""

    def __init__(self, d: Dims, caches: dict, row_ids, positions, lengths):
        self.d, self.caches = d, caches
        self.row_ids, self.positions = row_ids, positions
        self.offsets = torch.arange(d.prefill_chunk, device=positions.device)
        self.pos = positions.long()[:, None] + self.offsets
        self.valid = self.offsets[None, :] < lengths.long()[:, None]
        self.end = positions.long() + lengths.long()

    def window(self, owner: str, kv: torch.Tensor) -> torch.Tensor:
        d = self.d
        ring = self.caches[f"cache.{owner}.window"]
        history = ops.gather_rows(ring, self.row_ids, _before(self.positions, d.history), d.head_dim, d.window_format)
        new = ops.round_trip(kv, d.window_format)
        ops.write_rows(ring, kv, self.row_ids, self.pos % d.history, self.valid, d.window_format)
        return torch.cat([history, new], dim=1)

    def open_group(self, layer: int, ratio: int, rows: torch.Tensor) -> torch.Tensor:
        state = self.caches[f"cache.layer{layer}.state"]
        prev = ops.gather_rows(state, self.row_ids, _before(self.positions, ratio - 1), 2 * self.d.head_dim,
                               self.d.state_format)
        keep = open_group_rows(self.pos, self.valid, self.end, ratio)
        ops.write_rows(state, rows, self.row_ids, self.pos % ratio, keep, self.d.state_format)
        return prev

    def compressed(self, layer: int, entries: torch.Tensor, ratio: int) -> torch.Tensor:
        closes = ((self.pos + 1) % ratio == 0) & self.valid
        ops.write_rows(self.caches[f"cache.layer{layer}.compressed"], entries, self.row_ids, self.pos // ratio,
                       closes, self.d.compressed_format)
        return ops.round_trip(entries, self.d.compressed_format)

    def context(self, stage_index: int, rows: torch.Tensor) -> None:
        ops.write_rows(self.caches[f"cache.draft{stage_index}.window"], rows, self.row_ids, self.pos % self.d.history,
                       self.valid, self.d.window_format)


def _before(positions: torch.Tensor, count: int) -> torch.Tensor:
    """Absolute positions of the `count` rows just before each row's first position."""
    return positions.long()[:, None] + torch.arange(-count, 0, device=positions.device)


def open_group_rows(pos: torch.Tensor, valid: torch.Tensor, end: torch.Tensor, ratio: int) -> torch.Tensor:
    """Rows still in an open compressor group once positions < end are committed."""
    return valid & (pos >= (end // ratio * ratio)[:, None])
