"""The rewrites a recipe may name, and the pipeline built from its list."""

from __future__ import annotations

from b12x_toolchain.passes.fuse_window_snapshot import FUSE_WINDOW_SNAPSHOT
from b12x_toolchain.runtime.rewrite import PassError

REGISTRY = {FUSE_WINDOW_SNAPSHOT.name: FUSE_WINDOW_SNAPSHOT}  # passes keep no state: one instance serves all


def build_pipeline(names: list[str]) -> list:
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise PassError(f"unknown pass {unknown[0]!r}; known passes: {sorted(REGISTRY)}")
    return [REGISTRY[n] for n in names]
