"""Inputs for byte-equality checks of the cache writers: random rows plus the edge vectors.

Shared by the kernel tests (CPU, Triton interpreter) and `gpu_check.py` (GPU), so both
compare the same cases. Nothing here is a benchmark; it only builds tensors.
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.formats.layout import staging_shape

HISTORY = 128
# Zeros of both signs, the E4M3 limit and values around it (464 ties, 480 and above would
# be NaN without saturation), huge and infinite values, float32 subnormals, E4M3
# subnormal steps and a tie between them, and plain values at E2M1 midpoints.
EDGE_VALUES = (0.0, -0.0, 448.0, -448.0, 464.0, 479.9, 480.0, -1e30, 1e30, float("inf"), float("-inf"),
               1e-40, -1e-42, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 1.0, 0.75, -1.25, 5.0, 2.5, 1.9 * 2.0**100)


def edge_rows(dim: int) -> torch.Tensor:
    """Rows that each stress one rule of the formats: [9, dim] float32."""
    rows = torch.randn(9, dim, generator=torch.Generator().manual_seed(dim))
    rows[0, : len(EDGE_VALUES)] = torch.tensor(EDGE_VALUES)
    rows[1] = 0.0
    rows[2] = -0.0
    rows[3, dim // 2] = float("nan")  # one NaN poisons its block only
    rows[4, 1] = -float("nan")  # NaN of either sign writes the same canonical bytes
    rows[5] = torch.linspace(-1e-38, 1e-38, dim) * 1e-3  # float32 subnormals
    rows[6] = rows[6].abs() * 2.0**120  # huge but finite
    rows[7] = 1.9 * 2.0**5  # mantissa above 1.75 at the block maximum: saturates to 448
    rows[8] = torch.where(torch.arange(dim) % 2 == 0, 1e-30, 2.0**20)  # tiny beside huge
    return rows


def kv_rows(gen: torch.Generator, rows: int, width: int, dim: int) -> torch.Tensor:
    """[rows, width, dim] float32: random at mixed magnitudes with the edge rows spliced in."""
    kv = torch.randn(rows, width, dim, generator=gen) * torch.logspace(-3, 3, width)[None, :, None]
    edges = edge_rows(dim)
    flat = kv.view(-1, dim)
    for i in range(min(len(edges), flat.shape[0])):
        flat[(i * 5) % flat.shape[0]] = edges[i]
    return kv


def window_case(gen: torch.Generator, rows: int, width: int, dim: int, page_size: int, fmt: str = "mxfp8",
                slots: int = 5, device="cpu") -> dict:
    """Arguments of the window ops: random ring bytes, poisoned staging, kv, rows and positions.

    Positions cover a ring that has wrapped (200), one just past the window (129) and a
    short request whose history reaches before position 0 (5).
    """
    row_bytes = get_format(fmt).row_bytes(dim)
    ring = torch.randint(0, 256, (slots, HISTORY, row_bytes), dtype=torch.uint8, generator=gen)
    shape = staging_shape(rows, HISTORY + width, row_bytes, "NHD", page_size)
    case = {
        "ring": ring,
        "staging": torch.full(shape, 0xFF, dtype=torch.uint8),  # poisoned: every byte must be written
        "kv": kv_rows(gen, rows, width, dim),
        "row_ids": torch.tensor([3, 0, 4, 1][:rows], dtype=torch.int32),
        "positions": torch.tensor([200, 5, 129, 64][:rows], dtype=torch.int32),
        "accept_len": torch.tensor([width, 0, 3, 1][:rows], dtype=torch.int32),
    }
    return {k: v.to(device) for k, v in case.items()}
