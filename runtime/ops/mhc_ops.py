"""Op set v4's mHC op: the comb matrix of a hyper-connection mix, Sinkhorn included.

DeepSeek V4's manifold-constrained hyper-connections mix `n` residual streams through a
doubly stochastic `n x n` matrix: a softmax over the comb logits plus `eps`, then
Sinkhorn's alternating normalisation (one column pass, then `iters - 1` rounds of row and
column), each dividing by the sum plus `eps`. Written out, that is about six graph nodes
per round — with 20 rounds, two mixes per layer, roughly a third of every pass graph's
nodes and of the time spent tracing and saving it — for a few dozen floats per token.
As one op it is one node, one kernel launch on a GPU, and one loop over private memory
on the CPU.

The CPU reference is the written-out sequence itself, run in place on its own result:
every division and every sum is the same float32 operation in the same order, so it is
bitwise the unfused graph (tests compare it on random logits). The Triton kernel
(`triton_mhc`) agrees to float32 rounding: its exponential and sums are its own.
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.ops.define import fake_for, reference_op


def sinkhorn_unfused(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The written-out sequence, as the reference model states it: what the op computes.

    Tests compare the op with it, and compiled replay hands it to Inductor in the op's place
    (a loop of small elementwise steps is what Inductor fuses best; the op is opaque to it).
    """
    comb = logits.to(torch.float32).softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@reference_op()
def hc_sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """float32 [..., n, n] doubly stochastic comb matrix of comb logits [..., n, n]."""
    comb = logits.to(torch.float32).softmax(dim=-1).add_(eps)
    columns = comb.new_empty((*comb.shape[:-2], 1, comb.shape[-1]))
    rows = comb.new_empty((*comb.shape[:-1], 1))
    # In place into two small buffers: the same float32 operations as sinkhorn_unfused,
    # without a fresh tensor per step.
    comb.div_(torch.sum(comb, dim=-2, keepdim=True, out=columns).add_(eps))
    for _ in range(iters - 1):
        comb.div_(torch.sum(comb, dim=-1, keepdim=True, out=rows).add_(eps))
        comb.div_(torch.sum(comb, dim=-2, keepdim=True, out=columns).add_(eps))
    return comb


@fake_for(hc_sinkhorn)
def _(logits, iters, eps):
    return torch.empty_like(logits, dtype=torch.float32)


MHC_OPS = ("hc_sinkhorn",)
