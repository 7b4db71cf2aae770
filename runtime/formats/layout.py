"""Staging page layouts and the index arithmetic every cache op shares.

A staging buffer holds, per pass row, `history` snapshot rows followed by the rows the
pass appends, in pages of `page_size` tokens. DeepSeek V4.1 has one latent KV head, so
NHD `[rows, pages, page, 1, bytes]` and HND `[rows, pages, 1, page, bytes]` address the
same memory; both are accepted by the unfused ops, the fused op is qualified per layout.
"""

from __future__ import annotations

import math

import torch

LAYOUTS = ("NHD", "HND")


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


def staging_shape(rows, tokens: int, row_bytes: int, layout: str, page_size: int) -> list:
    """Shape of a paged staging buffer; `rows` may be a symbol such as "rows"."""
    if layout not in LAYOUTS:
        raise ValueError(f"staging layout {layout!r} is not supported; expected one of {LAYOUTS}")
    pages = pages_for(tokens, page_size)
    if layout == "NHD":
        return [rows, pages, page_size, 1, row_bytes]
    return [rows, pages, 1, page_size, row_bytes]


def token_view(staging: torch.Tensor) -> torch.Tensor:
    """[rows, pages*page, bytes] view of a paged staging buffer (one KV head: both layouts)."""
    return staging.view(staging.shape[0], -1, staging.shape[-1])


def ring_index(positions: torch.Tensor, offsets: torch.Tensor, capacity: int) -> torch.Tensor:
    """Ring rows of absolute positions `positions[:, None] + offsets` (Python-style modulo)."""
    return torch.remainder(positions.long()[:, None] + offsets, capacity)


def history_offsets(history: int, device) -> torch.Tensor:
    return torch.arange(-history, 0, device=device)
