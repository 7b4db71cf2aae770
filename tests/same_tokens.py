"""Decoded streams compared token for token: the one helper every decoding test uses.

A token's numbers do not depend on the pass, bucket or batch that computed it
(runtime/ops/fixed_order.py), so speculative, batched and served decoding give greedy
decoding's tokens exactly, with no tolerance for near ties.
"""

from __future__ import annotations


def assert_same_tokens(got: list[int], want: list[int], label: str = "") -> None:
    prefix = f"{label}: " if label else ""
    parted = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert parted is None, f"{prefix}token {parted} differs ({got[parted]} vs greedy {want[parted]})"
    assert len(got) == len(want), f"{prefix}{len(got)} tokens instead of greedy's {len(want)}"
