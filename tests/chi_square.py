"""Pearson's chi-square test of samples against a distribution: the sampling tests' one check."""

from __future__ import annotations

import torch


def chi_square_p_value(samples: list[int], expected: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of `samples` against the distribution `expected`.

    Tokens expected fewer than 5 times are pooled into one bin, as the test's chi-square
    approximation needs.
    """
    counts = torch.bincount(torch.tensor(samples), minlength=len(expected)).double()
    want = expected.double() * len(samples)
    rare = want < 5
    if rare.any():
        counts = torch.cat([counts[~rare], counts[rare].sum().view(1)])
        want = torch.cat([want[~rare], want[rare].sum().view(1)])
    statistic = ((counts - want) ** 2 / want).sum()
    dof = torch.tensor(len(want) - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))
