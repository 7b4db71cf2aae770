"""Weight names, shapes and deterministic random initialisation."""

from __future__ import annotations

import torch

from b12x.exporter.dims import Dims


def _block_shapes(d: Dims, prefix: str) -> dict[str, tuple[int, ...]]:
    """One attention + MLP block: the shape every target layer and draft stage shares."""
    return {
        prefix + "attn_norm": (d.hidden,),
        prefix + "wq": (d.heads * d.head_dim, d.hidden),
        prefix + "wkv": (d.head_dim, d.hidden),
        prefix + "kv_norm": (d.head_dim,),
        prefix + "wo": (d.hidden, d.heads * d.head_dim),
        prefix + "mlp_norm": (d.hidden,),
        prefix + "w_gate": (d.intermediate, d.hidden),
        prefix + "w_up": (d.intermediate, d.hidden),
        prefix + "w_down": (d.hidden, d.intermediate),
    }


def weight_specs(d: Dims) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every weight's (shape, dtype), by name, for either model family."""
    if d.family == "deepseek_v4":
        from b12x.exporter.v4_weights import v4_weight_specs

        return v4_weight_specs(d)
    return {name: (shape, "float32") for name, shape in _v41_shapes(d).items()}


def weight_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, (shape, _) in weight_specs(d).items()}


def _v41_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    shapes = {"embed": (d.vocab, d.hidden)}
    for i, ratio in enumerate(d.ratios):
        prefix = f"layers.{i}."
        shapes.update(_block_shapes(d, prefix))
        if ratio:
            shapes[prefix + "wc"] = (d.head_dim, d.hidden)
            shapes[prefix + "c_norm"] = (d.head_dim,)
        if ratio > 1:
            shapes[prefix + "wg"] = (d.head_dim, d.hidden)
    shapes["final_norm"] = (d.hidden,)
    shapes["lm_head"] = (d.vocab, d.hidden)
    shapes["draft.main_proj"] = (d.hidden, len(d.target_layer_ids) * d.hidden)
    shapes["draft.main_norm"] = (d.hidden,)
    for s in range(d.draft_stages):
        shapes.update(_block_shapes(d, f"draft.{s}."))
    shapes["draft.final_norm"] = (d.hidden,)
    return dict(sorted(shapes.items()))


def init_weights(d: Dims, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """Random weights from `seed`: the same seed gives the same bytes on every machine.

    Norm weights are ones; matrices are N(0, 1/fan_in) so activations keep unit scale and
    logits are spread out (top-2 near ties are rare, which keeps greedy checks sharp).
    """
    if d.family == "deepseek_v4":
        from b12x.exporter.v4_weights import v4_init_weights

        return v4_init_weights(d, seed, device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(d).items():
        if len(shape) == 1:
            tensor = torch.ones(shape)
        elif name == "embed":
            tensor = torch.randn(shape, generator=gen)
        else:
            tensor = torch.randn(shape, generator=gen) / shape[1] ** 0.5
        weights[name] = tensor.to(device)
    return weights
