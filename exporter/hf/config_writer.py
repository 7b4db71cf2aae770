"""A DeepSeek V4 recipe's model as a Hugging Face `config.json` document.

The inverse of reading a checkpoint's config: it lets a tiny recipe be instantiated in
`transformers` (the numerical reference in tests and benchmarks) and lets a user publish
weights exported from b12x's random init in the layout other tools read. Plain data only;
nothing here imports `transformers`.
"""

from __future__ import annotations


def hf_config_dict(recipe) -> dict:
    m = recipe.model
    if m.family != "deepseek_v4":
        raise ValueError(f"recipe {recipe.name!r} is family {m.family}; only deepseek_v4 has a transformers config")
    kinds = {0: "sliding_attention", m.csa_ratio: "compressed_sparse_attention",
             m.hca_ratio: "heavily_compressed_attention"}
    rope = {"rope_type": "default"}
    if m.yarn is not None:
        rope = {"rope_type": "yarn", "factor": m.yarn.factor, "beta_fast": m.yarn.beta_fast,
                "beta_slow": m.yarn.beta_slow, "original_max_position_embeddings": m.yarn.original_max_position_embeddings}
    return {
        "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "moe_intermediate_size": m.moe.intermediate_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads, "num_key_value_heads": 1,
        "head_dim": m.head_dim, "partial_rotary_factor": m.rope_head_dim / m.head_dim,
        "q_lora_rank": m.q_lora_rank, "o_groups": m.o_groups, "o_lora_rank": m.o_lora_rank,
        "layer_types": [kinds[r] for r in m.target_ratios],
        "compress_rates": {"compressed_sparse_attention": m.csa_ratio, "heavily_compressed_attention": m.hca_ratio},
        "sliding_window": m.window, "rms_norm_eps": m.rms_norm_eps, "rope_theta": m.rope_theta,
        "compress_rope_theta": m.compress_rope_theta, "rope_parameters": rope,
        "index_n_heads": m.indexer.heads, "index_head_dim": m.indexer.head_dim, "index_topk": m.indexer.topk,
        "hc_mult": m.hyper_connections.mult, "hc_sinkhorn_iters": m.hyper_connections.sinkhorn_iters,
        "hc_eps": m.hyper_connections.eps, "n_routed_experts": m.moe.experts,
        "num_experts_per_tok": m.moe.experts_per_token, "n_shared_experts": m.moe.shared_experts,
        "mlp_layer_types": ["hash_moe"] * m.moe.hash_layers + ["moe"] * (m.num_layers - m.moe.hash_layers),
        "scoring_func": m.moe.scoring, "routed_scaling_factor": m.moe.routed_scaling_factor,
        "swiglu_limit": m.moe.swiglu_limit, "max_position_embeddings": m.max_seq_len,
        "num_nextn_predict_layers": m.draft.stages, "tie_word_embeddings": False,
    }
