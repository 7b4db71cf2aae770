"""The rewrites a recipe may name, and the pipeline built from its list."""

from __future__ import annotations

from b12x_toolchain.passes.fuse_window_snapshot import FUSE_WINDOW_SNAPSHOT
from b12x_toolchain.runtime.rewrite import Rewrite, RewriteError

REWRITES = {FUSE_WINDOW_SNAPSHOT.name: FUSE_WINDOW_SNAPSHOT}  # rewrites keep no state: one instance serves all


def rewrites_named(names: list[str]) -> list[Rewrite]:
    unknown = [n for n in names if n not in REWRITES]
    if unknown:
        raise RewriteError(f"unknown rewrite {unknown[0]!r}; known rewrites: {sorted(REWRITES)}")
    return [REWRITES[n] for n in names]
