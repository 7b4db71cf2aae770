"""DeepSeek V4 / V4.1 compute blocks, on an explicit weights dict named as the checkpoint names them.

Each function mirrors one piece of the reference model: interleaved partial RoPE (with
YaRN on compressed layers), latent MQA with a learned per-head sink and a grouped output
projection, manifold-constrained hyper-connections, and the hash / routed MoE. Cache
access is not here: the pass modules hand these blocks decoded key rows and masks.
"""

from __future__ import annotations

import math

import torch

from b12x_toolchain.runtime.ops import fixed_order
from b12x_toolchain.runtime.ops.opset import ops


def rms_norm(x, weight, eps):
    # A bf16 norm weight multiplies in float32, as transformers' float32 model does.
    weight = weight if weight.dtype == torch.float32 else weight.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def unit_rms_norm(x, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


# --- RoPE ----------------------------------------------------------------------------

def inv_freq(theta: float, rope_dim: int, yarn: tuple | None, device=None) -> torch.Tensor:
    """Per-pair inverse frequencies; YaRN blends interpolated and extrapolated ones.

    Computed in the graph from `arange` (a package stores no tensor constants), with the
    reference's float32 operation order so the angles are bit-identical.
    """
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float, device=device) / rope_dim)
    if yarn is None:
        return 1.0 / pos_freqs
    factor, original, beta_fast, beta_slow = yarn

    def correction_dim(rotations):
        return (rope_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class Rotation:
    """RoPE at a set of positions, as tables over the rotated channels.

    Channel pair (2i, 2i+1) turns by angle_i, so a rotation is x * cos + swap_pairs(x) * sin
    with cos = (c_i, c_i) and sin = (-s_i, s_i) interleaved: x1*c - x2*s and x2*c + x1*s,
    the reference's products and sums bit for bit (a + (-b) is a - b in IEEE arithmetic).
    A pass builds each table once and every layer that rotates at those positions shares it;
    per call that leaves nine graph nodes where the pairwise form and its broadcasts took
    fifteen, and graph nodes are what a full-size capture pays for in tracing time.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin
        self._heads = self._inverse = None

    def heads(self) -> "Rotation":
        """The same rotation broadcast over a heads axis before the channels ([R, T, 1, width])."""
        if self._heads is None:
            self._heads = Rotation(self.cos[:, :, None], self.sin[:, :, None])
        return self._heads

    def with_views(self) -> "Rotation":
        """This rotation, its heads and inverse views built now: made before the layers rather
        than in whichever reads them first, so that layers traced once and copied share them."""
        self.heads().inverse()
        return self

    def inverse(self) -> "Rotation":
        """The rotation by minus the angles."""
        if self._inverse is None:
            self._inverse = Rotation(self.cos, -self.sin)
        return self._inverse


def rope_angles(pos: torch.Tensor, freqs: torch.Tensor) -> Rotation:
    angle = pos.to(torch.float32)[..., None] * freqs.to(pos.device)
    cos, sin = angle.cos(), angle.sin()
    return Rotation(torch.stack((cos, cos), dim=-1).flatten(-2), torch.stack((-sin, sin), dim=-1).flatten(-2))


def rope(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """Rotate consecutive channel pairs of the trailing rotation-width channels."""
    width = rotation.cos.shape[-1]
    nope, r = x[..., :-width], x[..., -width:]
    swapped = r.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return torch.cat([nope, r * rotation.cos + swapped * rotation.sin], dim=-1)


# --- attention output (attention itself is the op set's sparse_attention) -------------

def grouped_out(w, a, out, groups, linear):
    """Grouped low-rank output projection: per head group to o_lora_rank, then mixed.
    `linear`: the model's Linears (linears.py)."""
    R, T = out.shape[:2]
    x = out.reshape(R, T, groups, -1)
    y = linear.grouped(w, a + "o_a_proj.weight", x)
    return linear(w, a + "o_b_proj.weight", y.flatten(2))


# --- hyper-connections -----------------------------------------------------------------

def hc_mix(w, prefix, streams, iters, hc_eps, eps):
    """Pre/post/comb weights from the streams [R,T,N,D]; returns (post, comb, collapsed)."""
    n = streams.shape[-2]
    flat = unit_rms_norm(streams.flatten(-2), eps)
    mix = ops.dense_linear(flat, w[prefix + "fn"])
    base, scale = w[prefix + "base"], w[prefix + "scale"]
    pre = fixed_order.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * fixed_order.sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = mix[..., 2 * n :].unflatten(-1, (n, n)) * scale[2] + base[2 * n :].view(n, n)
    # Softmax, then Sinkhorn towards a doubly stochastic matrix: one op (runtime/ops/mhc_ops.py)
    # where the written-out loop is about six graph nodes per round.
    comb = ops.hc_sinkhorn(comb_logits, iters, hc_eps)
    collapsed = (pre[..., None] * streams).sum(dim=-2)
    return post, comb, collapsed


def hc_merge(post, comb, block_out, streams):
    """Expand a block's output to the streams and add the comb-mixed residual.

    The mix is written out (stream i gets the sum over j of comb[j, i] * streams[j]): a
    batched matrix product would pick its kernel by the number of tokens."""
    mixed = (comb[..., :, :, None] * streams[..., :, None, :]).sum(dim=-3)
    return post[..., None] * block_out[..., None, :] + mixed


def hc_head(w, prefix, streams, hc_eps, eps):
    flat = unit_rms_norm(streams.flatten(-2), eps)
    mix = ops.dense_linear(flat, w[prefix + "hc_head.hc_fn"])
    pre = fixed_order.sigmoid(mix * w[prefix + "hc_head.hc_scale"] + w[prefix + "hc_head.hc_base"]) + hc_eps
    return (pre[..., None] * streams).sum(dim=-2)


# --- MoE -------------------------------------------------------------------------------

# Activations from fixed_order: torch's own round a value by where it sits in the tensor.
SCORING = {
    "sqrtsoftplus": lambda x: fixed_order.softplus(x).sqrt(),
    "sigmoid": fixed_order.sigmoid,
    "softmax": lambda x: x.softmax(dim=-1),
}


def _swiglu(gate, up, limit):
    return fixed_order.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def moe(w, m, x, tokens, v, linear, mesh=None):
    """Routed experts (dense over experts, weights zero where not routed) plus shared ones.

    x [R,T,D]; hash layers take their experts from the token-id table `tid2eid`. Across
    ranks (`mesh`, parallel.py) every rank routes over all experts and computes its own
    experts, or its slice of each; the sum over ranks is the output. Block-scaled experts
    (`linear`, linears.py) are computed for the chosen experts only.
    """
    scores = SCORING[v.scoring](linear(w, m + "gate.weight", x))
    if m + "gate.tid2eid" in w:
        chosen = w[m + "gate.tid2eid"][tokens.long()]
    else:
        chosen = torch.topk(scores + w[m + "gate.e_score_correction_bias"], v.experts_per_token, dim=-1).indices
    picked = scores.gather(-1, chosen)
    picked = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20) * v.routed_scaling
    local = None if mesh is None else mesh.experts(scores.shape[-1])
    if linear.quantized(m + "experts.gate_up_proj"):
        routed = linear.routed(w, m, x, chosen, picked, local, lambda gate, up: _swiglu(gate, up, v.swiglu_limit))
    else:
        weights = torch.zeros_like(scores).scatter(-1, chosen, picked)  # [R,T,E]
        if local is not None:
            weights = weights[..., local]
        gate_up_proj, down_proj = linear.value(w, m + "experts.gate_up_proj"), linear.value(w, m + "experts.down_proj")
        experts = gate_up_proj.shape[0]
        gate_up = ops.dense_linear(x, gate_up_proj.flatten(0, 1)).unflatten(-1, (experts, -1))  # [R,T,E,2I]
        h = _swiglu(*gate_up.chunk(2, dim=-1), v.swiglu_limit)
        down = torch.stack([ops.dense_linear(h[..., e, :], down_proj[e]) for e in range(experts)], dim=-1)  # [R,T,D,E]
        routed = (down * weights[..., None, :]).sum(dim=-1)
    if m + "shared_experts.gate_proj.weight" not in w:
        return routed if mesh is None else mesh.reduce(routed)
    s = m + "shared_experts."
    shared = _swiglu(linear(w, s + "gate_proj.weight", x), linear(w, s + "up_proj.weight", x), v.swiglu_limit)
    shared = linear(w, s + "down_proj.weight", shared)
    if mesh is None or mesh.world_size == 1:
        return routed + shared
    # Split by tensor parallelism, shared experts are summed over ranks too; whole on every rank, once.
    return mesh.reduce(routed + shared) if mesh.tensor > 1 else mesh.reduce(routed) + shared


# --- compressor pooling ------------------------------------------------------------------

def pool(series, positions, ratio, width, bias, overlap):
    """Softmax-gated pool of the rows ending at each position.

    series [R, S, 2*width] holds raw [kv | gate] rows at absolute `positions` [R, S]; the
    last T = S - span + 1 rows are this pass's. Rows at negative positions do not exist
    (weight 0). Non-overlapping: the `ratio` rows of a group, gate + bias[j]. Overlapping
    (CSA): the previous group's first series (Ca) beside this group's second series (Cb),
    2 * ratio slots. The result [R, T, dim] is meaningful where a group closes.
    """
    span = 2 * ratio if overlap else ratio
    exists = positions >= 0
    kv = torch.where(exists[..., None], series[..., :width], torch.zeros_like(series[..., :width]))
    gate = series[..., width:].masked_fill(~exists[..., None], float("-inf"))
    kv, gate = kv.unfold(1, span, 1), gate.unfold(1, span, 1)  # [R, T, width, span]
    if overlap:
        dim = width // 2
        kv = torch.cat([kv[:, :, :dim, :ratio], kv[:, :, dim:, ratio:]], dim=-1)
        gate = torch.cat([gate[:, :, :dim, :ratio] + bias[:, :dim].t(), gate[:, :, dim:, ratio:] + bias[:, dim:].t()],
                         dim=-1)
    else:
        gate = gate + bias.t()
    return (kv * gate.softmax(dim=-1)).sum(dim=-1)
