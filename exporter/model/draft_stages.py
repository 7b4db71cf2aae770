"""What every kind of draft stage has: a window ring per stage, fed by context rows that
verify stages for each position and commit makes persistent for the accepted ones."""

from __future__ import annotations

from b12x_toolchain.exporter.model import buffer_names as names
from b12x_toolchain.exporter.model.buffers import cache, staged_rows, window_staging
from b12x_toolchain.runtime.ops.opset import ops


class DraftStages:
    def __init__(self, d, compute=None):
        self.d, self.c = d, compute

    def cache_specs(self):
        d = self.d
        return [spec for s in range(d.draft_stages) for spec in
                [cache(names.stage_cache("draft_window", s), "draft_window", d.history, d.window_format, d.head_dim,
                       stage=s)]
                + self.stage_cache_specs(s)]

    def verify_staging_specs(self):
        d = self.d
        return [spec for s in range(d.draft_stages) for spec in
                [staged_rows(names.stage_staging("verify", "draft_context_staging", s), "draft_context_staging",
                             d.verify_width, d.window_format, d.head_dim, stage=s)]
                + self.stage_staging_specs(s)]

    def draft_staging_specs(self):
        return [window_staging(names.stage_staging("draft", "draft_window_staging", s), self.d, self.d.draft_width,
                               stage=s)
                for s in range(self.d.draft_stages)]

    def commit(self, caches, staging, row_ids, pos, accepted, end):
        for s in range(self.d.draft_stages):
            ops.write_rows(caches[names.stage_cache("draft_window", s)],
                           staging[names.stage_staging("verify", "draft_context_staging", s)], row_ids,
                           pos % self.d.history, accepted, "bytes")
            self.commit_stage(s, caches, staging, row_ids, pos, accepted, end)

    # -- what a kind of stage adds ------------------------------------------------------

    def stage_cache_specs(self, stage: int) -> list:
        return []

    def stage_staging_specs(self, stage: int) -> list:
        return []

    def commit_stage(self, stage, caches, staging, row_ids, pos, accepted, end) -> None:
        pass

    def outputs(self) -> list:
        return []
