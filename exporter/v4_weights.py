"""DeepSeek V4 weights: names, shapes and dtypes, as a Hugging Face checkpoint stores them.

Names are the checkpoint's own (`model.layers.3.self_attn.q_a_proj.weight`), so importing
a `save_pretrained` directory maps names one to one. The MTP stage, which `transformers`
does not load, is stored under `mtp.{s}.` with the decoder-layer names of a target layer
plus its input projections (`e_proj`, `h_proj`, `enorm`, `hnorm`), `hc_head` and `norm`.
"""

from __future__ import annotations

import torch

from b12x.exporter.dims import Dims

Spec = tuple[tuple[int, ...], str]  # (shape, dtype)


def _hc(d: Dims, prefix: str) -> dict[str, Spec]:
    v, D = d.v4, d.hidden
    width = (2 + v.hc_mult) * v.hc_mult
    return {prefix + "fn": ((width, v.hc_mult * D), "float32"), prefix + "base": ((width,), "float32"),
            prefix + "scale": ((3,), "float32")}


def _compressor(d: Dims, prefix: str, ratio: int, dim: int, overlap: bool) -> dict[str, Spec]:
    width = 2 * dim if overlap else dim  # CSA pools two series (Ca | Cb) per token
    return {prefix + "kv_proj.weight": ((width, d.hidden), "float32"),
            prefix + "gate_proj.weight": ((width, d.hidden), "float32"),
            prefix + "position_bias": ((ratio, width), "float32"),
            prefix + "kv_norm.weight": ((dim,), "float32")}


def _layer(d: Dims, prefix: str, ratio: int, hash_routed: bool) -> dict[str, Spec]:
    v, D, H, hd = d.v4, d.hidden, d.heads, d.head_dim
    a = prefix + "self_attn."
    specs = {
        prefix + "input_layernorm.weight": ((D,), "float32"),
        prefix + "post_attention_layernorm.weight": ((D,), "float32"),
        a + "q_a_proj.weight": ((v.q_lora_rank, D), "float32"),
        a + "q_a_norm.weight": ((v.q_lora_rank,), "float32"),
        a + "q_b_proj.weight": ((H * hd, v.q_lora_rank), "float32"),
        a + "kv_proj.weight": ((hd, D), "float32"),
        a + "kv_norm.weight": ((hd,), "float32"),
        a + "o_a_proj.weight": ((v.o_groups * v.o_lora_rank, H * hd // v.o_groups), "float32"),
        a + "o_b_proj.weight": ((D, v.o_groups * v.o_lora_rank), "float32"),
        a + "sinks": ((H,), "float32"),
    }
    specs.update(_hc(d, prefix + "attn_hc."))
    specs.update(_hc(d, prefix + "ffn_hc."))
    kind = v.kind(ratio)
    if kind == "csa":
        c = a + "compressor."
        specs.update(_compressor(d, c, ratio, hd, overlap=True))
        specs.update(_compressor(d, c + "indexer.", ratio, v.index_head_dim, overlap=True))
        specs[c + "indexer.q_b_proj.weight"] = ((v.index_heads * v.index_head_dim, v.q_lora_rank), "float32")
        specs[c + "indexer.scorer.weights_proj.weight"] = ((v.index_heads, D), "float32")
    elif kind == "hca":
        specs.update(_compressor(d, a + "compressor.", ratio, hd, overlap=False))
    m, E, I = prefix + "mlp.", v.experts, d.intermediate
    specs[m + "gate.weight"] = ((E, D), "float32")
    if hash_routed:
        specs[m + "gate.tid2eid"] = ((d.vocab, v.experts_per_token), "int64")
    else:
        specs[m + "gate.e_score_correction_bias"] = ((E,), "float32")
    specs[m + "experts.gate_up_proj"] = ((E, 2 * I, D), "float32")
    specs[m + "experts.down_proj"] = ((E, D, I), "float32")
    if v.shared_experts:
        for name, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            specs[f"{m}shared_experts.{name}.weight"] = (shape, "float32")
    return specs


def _head(d: Dims, prefix: str) -> dict[str, Spec]:
    v, D = d.v4, d.hidden
    return {prefix + "hc_head.hc_fn": ((v.hc_mult, v.hc_mult * D), "float32"),
            prefix + "hc_head.hc_base": ((v.hc_mult,), "float32"),
            prefix + "hc_head.hc_scale": ((1,), "float32"),
            prefix + "norm.weight": ((D,), "float32")}


def v4_weight_specs(d: Dims) -> dict[str, Spec]:
    """Every weight of the model, target and MTP stages, sorted by name."""
    D = d.hidden
    specs = {"model.embed_tokens.weight": ((d.vocab, D), "float32"), "lm_head.weight": ((d.vocab, D), "float32")}
    specs.update(_head(d, "model."))
    for i, ratio in enumerate(d.ratios):
        specs.update(_layer(d, f"model.layers.{i}.", ratio, i < d.v4.hash_layers))
    for s in range(d.draft_stages):
        p = f"mtp.{s}."
        specs.update({p + "enorm.weight": ((D,), "float32"), p + "hnorm.weight": ((D,), "float32"),
                      p + "e_proj.weight": ((D, D), "float32"), p + "h_proj.weight": ((D, D), "float32")})
        specs.update(_layer(d, p, 0, hash_routed=False))
        specs.update(_head(d, p))
    return dict(sorted(specs.items()))


def v4_init_weights(d: Dims, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """Random weights from `seed`, scaled so activations keep unit size through the layers.

    Unlike the `transformers` init (zero sinks and position biases, identity-like mHC),
    every tensor is non-trivial, so a test comparing against the reference exercises it.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for name, (shape, dtype) in v4_weight_specs(d).items():
        if dtype == "int64":  # hash routing table: distinct experts per token
            ranks = torch.rand((shape[0], d.v4.experts), generator=gen).argsort(dim=-1)
            tensor = ranks[:, : shape[1]].contiguous()
        elif name.endswith(("norm.weight", "hc_scale")) or name.endswith("_hc.scale"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1 or name.endswith("position_bias"):
            tensor = 0.5 * torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            tensor = torch.randn(shape, generator=gen)
        else:
            tensor = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        out[name] = tensor.to(device)
    return out
