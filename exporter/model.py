"""DeepSeek V4.1-shaped compute blocks, written against an explicit weights dict.

Weights are graph inputs (stored once in weights.safetensors), so every block takes the
weights mapping `w` and a name prefix. Compute that does not touch caches is simplified
here (dense SwiGLU MLP in place of the MoE, no mHC, no indexer); cache structure is not:
window rows are RoPE'd latent KV rows (K = V, one KV head), ratio-2 layers pool a
non-overlapping group with a channelwise softmax, ratio-1 layers keep `norm(wc(h))`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float, rope_dim: int) -> torch.Tensor:
    """Rotate the trailing `rope_dim` channels of x [..., D] by positions pos (broadcast to x[..., 0])."""
    half = rope_dim // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = pos.to(torch.float32)[..., None] * inv_freq
    cos, sin = angle.cos(), angle.sin()
    nope, x1, x2 = x[..., : -rope_dim], x[..., -rope_dim:-half], x[..., -half:]
    return torch.cat([nope, x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def attend(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Single-latent MQA (K = V): q [R,T,H,D], keys [R,S,D], visible [R,T,S] -> [R,T,H*D]."""
    scores = torch.einsum("rthd,rsd->rths", q, keys) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    out = torch.einsum("rths,rsd->rthd", scores.softmax(dim=-1), keys)
    return out.flatten(2)


def mask_unseen(keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Zero key rows no query may see: stale or poisoned bytes must not reach 0 * NaN."""
    return torch.where(visible.any(dim=1)[..., None], keys, torch.zeros_like(keys))


def swiglu(w: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate = F.linear(x, w[prefix + "w_gate"])
    up = F.linear(x, w[prefix + "w_up"])
    return F.linear(F.silu(gate) * up, w[prefix + "w_down"])


def pool_groups(series: torch.Tensor, ratio: int, dim: int) -> torch.Tensor:
    """Channelwise-softmax pool over the `ratio` rows ending at each position.

    series [R, ratio-1+T, 2*dim] holds [kv | score] rows starting `ratio-1` positions
    before the pass; the result [R, T, dim] is meaningful where a group closes.
    """
    windows = series.unfold(1, ratio, 1)  # [R, T, 2*dim, ratio]
    kv, score = windows[:, :, :dim], windows[:, :, dim:]
    return (kv * score.softmax(dim=-1)).sum(dim=-1)
