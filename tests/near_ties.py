"""Greedy streams compared up to near ties: the one helper every decoding test uses."""

from __future__ import annotations

NEAR_TIE = 1e-5  # top-2 logit gap below which two batch shapes may pick different argmaxes


def first_difference(got: list[int], want: list[int], margins: list[float], label: str = "") -> int | None:
    """None when `got` is `want`; the index of a first difference at a near tie; fails otherwise.

    Different batch shapes (rows buckets, chunks) may round differently, so a token may
    differ where the reference's top two logits were within NEAR_TIE; after that the
    sequences are free to part. `margins` are the reference's gaps, token by token.
    """
    prefix = f"{label}: " if label else ""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert margins[i] < NEAR_TIE, (
                f"{prefix}token {i} differs ({a} vs greedy {b}) with top-2 margin {margins[i]:.3g} >= {NEAR_TIE}")
            print(f"{prefix}first difference at token {i}, a near tie (margin {margins[i]:.3g})")
            return i
    assert len(got) == len(want), f"{prefix}{len(got)} tokens instead of greedy's {len(want)}"
    return None
