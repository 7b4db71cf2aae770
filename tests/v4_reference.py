"""The independent reference for DeepSeek V4: `transformers`' DeepseekV4ForCausalLM on a
tiny config mirroring a b12x recipe, built locally (nothing is downloaded)."""

from __future__ import annotations

import torch

from b12x.exporter.dims import Dims

LAYER_TYPES = {0: "sliding_attention"}


def hf_config(recipe):
    from transformers import DeepseekV4Config

    m = recipe.model
    kinds = {0: "sliding_attention", m.csa_ratio: "compressed_sparse_attention",
             m.hca_ratio: "heavily_compressed_attention"}
    rope = {"rope_type": "default"}
    if m.yarn is not None:
        rope = {"rope_type": "yarn", "factor": m.yarn.factor, "beta_fast": m.yarn.beta_fast,
                "beta_slow": m.yarn.beta_slow,
                "original_max_position_embeddings": m.yarn.original_max_position_embeddings}
    return DeepseekV4Config(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, moe_intermediate_size=m.moe.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, head_dim=m.head_dim,
        partial_rotary_factor=m.rope_head_dim / m.head_dim, q_lora_rank=m.q_lora_rank,
        o_groups=m.o_groups, o_lora_rank=m.o_lora_rank,
        layer_types=[kinds[r] for r in m.target_ratios],
        compress_rates={"compressed_sparse_attention": m.csa_ratio, "heavily_compressed_attention": m.hca_ratio},
        sliding_window=m.window, rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta,
        compress_rope_theta=m.compress_rope_theta, rope_parameters=rope,
        index_n_heads=m.indexer.heads, index_head_dim=m.indexer.head_dim, index_topk=m.indexer.topk,
        hc_mult=m.hyper_connections.mult, hc_sinkhorn_iters=m.hyper_connections.sinkhorn_iters,
        hc_eps=m.hyper_connections.eps, n_routed_experts=m.moe.experts, num_experts_per_tok=m.moe.experts_per_token,
        n_shared_experts=m.moe.shared_experts,
        mlp_layer_types=["hash_moe"] * m.moe.hash_layers + ["moe"] * (m.num_layers - m.moe.hash_layers),
        scoring_func=m.moe.scoring, routed_scaling_factor=m.moe.routed_scaling_factor,
        swiglu_limit=m.moe.swiglu_limit, max_position_embeddings=m.max_seq_len, num_nextn_predict_layers=1,
        tie_word_embeddings=False,
    )


def reference_model(recipe, weights: dict[str, torch.Tensor]):
    """The reference with `weights` (b12x names are the checkpoint's; MTP tensors are ignored)."""
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(hf_config(recipe)).eval()
    model.load_state_dict({k: v for k, v in weights.items() if not k.startswith("mtp.")}, strict=True)
    return model


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """One full forward, no cache: [len(tokens), vocab]."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def dims(recipe) -> Dims:
    return Dims.from_recipe(recipe)
