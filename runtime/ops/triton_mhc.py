"""Triton kernel for `hc_sinkhorn`: one program per block of comb matrices, in registers.

Each program loads `BLOCK` matrices of `n x n` logits (n padded to a power of two, the
padding masked out of every sum), takes the softmax along rows, adds `eps`, and runs the
Sinkhorn rounds without touching memory again: one launch where the written-out graph
launches about six kernels per round. Its exponential and its sums are Triton's, so it
agrees with the CPU reference to float32 rounding, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 16  # matrices per program


@triton.jit
def _sinkhorn_kernel(x, out, count, iters, eps, N: tl.constexpr, N_P2: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)[:, None, None]
    i = tl.arange(0, N_P2)[None, :, None]
    j = tl.arange(0, N_P2)[None, None, :]
    live = (m < count) & (i < N) & (j < N)
    at = m.to(tl.int64) * (N * N) + i * N + j
    logits = tl.load(x + at, mask=live, other=float("-inf"))
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    e = tl.where(live, e, 0.0)
    comb = tl.where(live, e / tl.sum(e, axis=2)[:, :, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    tl.store(out + at, comb, mask=live)


def hc_sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    n = logits.shape[-1]
    x = logits.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    count = x.numel() // (n * n)
    if count:
        _sinkhorn_kernel[(triton.cdiv(count, BLOCK),)](x, out, count, iters, eps, N=n,
                                                       N_P2=triton.next_power_of_2(n), BLOCK=BLOCK)
    return out
