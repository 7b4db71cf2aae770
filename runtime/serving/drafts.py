"""Drafts from the draft pass: greedy tokens per row, ended where the drafter loses confidence."""

from __future__ import annotations

import torch


def confident_drafts(out: dict, manifest) -> list[list[int]]:
    """Greedy drafts per row from a draft pass's outputs, ended at the first row whose
    confidence (DSpark's sigmoid head) is below the package's threshold."""
    drafts = out["logits"].argmax(-1).tolist()
    return [d[:n] for d, n in zip(drafts, confident_lengths(out, manifest))]


def confident_lengths(out: dict, manifest) -> list[int]:
    """`manifest`: the package's typed Manifest (runtime/package/manifest.py)."""
    rows, width = out["logits"].shape[:2]
    threshold = manifest.model.confidence_threshold
    if "confidence" not in out or threshold <= 0:
        return [width] * rows
    low = (out["confidence"] < threshold).to(torch.int64)
    # index of the first low row, or width when there is none
    first = torch.where(low.any(dim=1), low.argmax(dim=1), torch.full((rows,), width))
    return first.tolist()
