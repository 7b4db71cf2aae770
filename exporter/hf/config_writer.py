"""A DeepSeek V4 / V4.1 recipe's model as a Hugging Face `config.json` document.

The inverse of reading a checkpoint's config: it lets a tiny V4 recipe be instantiated in
`transformers` (the numerical reference in tests and benchmarks), lets a tiny V4.1 recipe
be written as a release checkpoint states it, and lets a user publish weights exported
from b12x's random init in the layout other tools read. Plain data only; nothing here
imports `transformers`.
"""

from __future__ import annotations

from b12x_toolchain.exporter.model.engram_hashing import layer_primes


def _shared(m) -> dict:
    """The keys V4 and V4.1 configs state alike."""
    return {
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "moe_intermediate_size": m.moe.intermediate_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads, "num_key_value_heads": 1,
        "head_dim": m.head_dim, "q_lora_rank": m.q_lora_rank, "o_groups": m.o_groups, "o_lora_rank": m.o_lora_rank,
        "sliding_window": m.window, "rms_norm_eps": m.rms_norm_eps, "rope_theta": m.rope_theta,
        "compress_rope_theta": m.compress_rope_theta,
        "index_n_heads": m.indexer.heads, "index_head_dim": m.indexer.head_dim, "index_topk": m.indexer.topk,
        "hc_mult": m.hyper_connections.mult, "hc_sinkhorn_iters": m.hyper_connections.sinkhorn_iters,
        "hc_eps": m.hyper_connections.eps, "n_routed_experts": m.moe.experts,
        "num_experts_per_tok": m.moe.experts_per_token, "n_shared_experts": m.moe.shared_experts,
        "scoring_func": m.moe.scoring, "routed_scaling_factor": m.moe.routed_scaling_factor,
        "swiglu_limit": m.moe.swiglu_limit, "num_nextn_predict_layers": m.draft.stages, "tie_word_embeddings": False,
    }


def _rope(m) -> dict:
    if m.yarn is None:
        return {"rope_type": "default"}
    return {"rope_type": "yarn", "factor": m.yarn.factor, "beta_fast": m.yarn.beta_fast,
            "beta_slow": m.yarn.beta_slow, "original_max_position_embeddings": m.yarn.original_max_position_embeddings}


def hf_config_dict(recipe) -> dict:
    m = recipe.model
    if m.family != "deepseek_v4":
        raise ValueError(f"recipe {recipe.name!r} is family {m.family}; only deepseek_v4 has a transformers config")
    kinds = {0: "sliding_attention", m.csa_ratio: "compressed_sparse_attention",
             m.hca_ratio: "heavily_compressed_attention"}
    return {
        "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], **_shared(m),
        "partial_rotary_factor": m.rope_head_dim / m.head_dim,
        "layer_types": [kinds[r] for r in m.target_ratios],
        "compress_rates": {"compressed_sparse_attention": m.csa_ratio, "heavily_compressed_attention": m.hca_ratio},
        "rope_parameters": _rope(m),
        "mlp_layer_types": ["hash_moe"] * m.moe.hash_layers + ["moe"] * (m.num_layers - m.moe.hash_layers),
        "max_position_embeddings": m.max_seq_len,
    }


def v41_config_dict(recipe, block_size: int | None = None) -> dict:
    """config.json as a DeepSeek V4.1 release states `recipe`'s model (`dspark_block_size`:
    the drafted block, the draft pass's width unless given)."""
    m = recipe.model
    if m.family != "deepseek_v41":
        raise ValueError(f"recipe {recipe.name!r} is family {m.family}; expected deepseek_v41")
    c, d, e = m.csa2, m.draft, m.engram
    config = {
        "model_type": "deepseek_v41", **_shared(m), "qk_rope_head_dim": m.rope_head_dim,
        "compress_ratios": list(m.compress_ratios), "rope_scaling": _rope(m), "num_hash_layers": m.moe.hash_layers,
        "kv_source_layer_ids": list(c.kv_source_layer_ids), "index_source_layer_ids": list(c.index_source_layer_ids),
        "candidate_source_layer_id": c.candidate_source_layer_id, "candidate_topk_blocks": c.candidate_topk_blocks,
        "candidate_block_size": c.candidate_block_size,
        "dspark_block_size": recipe.passes.draft.width if block_size is None else block_size,
        "dspark_target_layer_ids": list(d.target_layer_ids), "dspark_noise_token_id": d.noise_token_id,
        "dspark_markov_rank": d.markov_rank, "dspark_n_routed_experts": d.moe.experts,
        "dspark_num_experts_per_tok": d.moe.experts_per_token,
    }
    if e is not None:
        primes = layer_primes(e.prime_search_start, list(e.layer_ids), e.max_ngram - 1, e.heads_per_order)
        config.update({
            "engram_layer_ids": list(e.layer_ids), "engram_max_ngram_size": e.max_ngram,
            "engram_n_heads": e.heads_per_order, "engram_head_dim": e.head_dim,
            "engram_vocab_size": e.prime_search_start, "engram_compressed_vocab_size": e.compressed_vocab_size,
            "engram_pad_token_id": e.pad_id, "engram_num_embeddings": [sum(primes[i]) for i in e.layer_ids]})
    return config
