"""DeepSeek V4 cache access beyond the window: compressor state rings, compressed entries
and the MTP stage's inputs, through staging (verify) or directly (prefill).

A state ring keeps the raw [kv | gate] rows of the last `span - 1` committed positions at
row `pos % span`: exactly what the next pass's first closing group can still need.
"""

from __future__ import annotations

import torch

from b12x.exporter.cache_io import DirectIO, StagedIO, _before

ops = torch.ops.b12x
STATE_FORMAT = "fp32"


class V4StagedIO(StagedIO):
    def state(self, name: str, span: int, rows: torch.Tensor) -> torch.Tensor:
        prev = ops.gather_rows(self.caches[f"cache.{name}"], self.row_ids, _before(self.positions, span - 1),
                               rows.shape[-1], STATE_FORMAT)
        ops.stage_rows(self.staging[f"staging.verify.{name}"], rows, STATE_FORMAT)
        return prev

    def entries(self, name: str, entries: torch.Tensor, ratio: int, fmt: str) -> torch.Tensor:
        stage = self.staging[f"staging.verify.{name}"]
        ops.stage_rows(stage, entries, fmt)
        return ops.read_rows(stage, entries.shape[-1], fmt)[:, : entries.shape[1]]

    def rows(self, stage: str, cache: str, rows: torch.Tensor, fmt: str, last_only: bool) -> None:
        """Per-position rows (MTP context, streams); commit picks what it keeps."""
        ops.stage_rows(self.staging[f"staging.verify.{stage}"], rows, fmt)


class V4DirectIO(DirectIO):
    def state(self, name: str, span: int, rows: torch.Tensor) -> torch.Tensor:
        cache = self.caches[f"cache.{name}"]
        prev = ops.gather_rows(cache, self.row_ids, _before(self.positions, span - 1), rows.shape[-1], STATE_FORMAT)
        keep = self.valid & (self.pos > self.end[:, None] - span)
        ops.write_rows(cache, rows, self.row_ids, self.pos % span, keep, STATE_FORMAT)
        return prev

    def entries(self, name: str, entries: torch.Tensor, ratio: int, fmt: str) -> torch.Tensor:
        closes = ((self.pos + 1) % ratio == 0) & self.valid
        ops.write_rows(self.caches[f"cache.{name}"], entries, self.row_ids, self.pos // ratio, closes, fmt)
        return ops.round_trip(entries, fmt)

    def rows(self, stage: str, cache: str, rows: torch.Tensor, fmt: str, last_only: bool) -> None:
        """A ring row per position, or (last_only) one row per slot: the last position's."""
        buffer = self.caches[f"cache.{cache}"]
        if last_only:
            ops.write_rows(buffer, rows, self.row_ids, torch.zeros_like(self.pos),
                           self.valid & (self.pos == self.end[:, None] - 1), fmt)
        else:
            ops.write_rows(buffer, rows, self.row_ids, self.pos % buffer.shape[1], self.valid, fmt)
