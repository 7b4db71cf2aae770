"""Everything the pass modules need from a recipe, flattened into one frozen object."""

from __future__ import annotations

from dataclasses import dataclass

from b12x.runtime.formats import get_format


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    intermediate: int
    ratios: tuple[int, ...]  # per target layer: 0 window-only, 1 or 2 compressed
    draft_stages: int
    target_layer_ids: tuple[int, ...]
    noise_token_id: int
    window: int
    history: int
    max_seq_len: int
    eps: float
    rope_theta: float
    compress_rope_theta: float
    window_format: str
    compressed_format: str
    state_format: str
    layout: str
    page_size: int
    prefill_chunk: int
    verify_width: int
    draft_width: int
    family: str = "deepseek_v41"
    v4: "V4Dims | None" = None  # the DeepSeek V4 fields, for family deepseek_v4

    @classmethod
    def from_recipe(cls, recipe) -> "Dims":
        m, c, p = recipe.model, recipe.cache, recipe.passes
        if m.family == "deepseek_v4":
            return cls(
                vocab=m.vocab_size, hidden=m.hidden_size, heads=m.num_heads, head_dim=m.head_dim,
                rope_dim=m.rope_head_dim, intermediate=m.moe.intermediate_size,
                ratios=tuple(m.compress_ratios[: m.num_layers]), draft_stages=m.draft.stages,
                target_layer_ids=(), noise_token_id=0,
                window=m.window, history=c.history, max_seq_len=m.max_seq_len, eps=m.rms_norm_eps,
                rope_theta=m.rope_theta, compress_rope_theta=m.compress_rope_theta,
                window_format=c.window_format, compressed_format=c.compressed_format,
                state_format=c.state_format, layout=c.staging.layout, page_size=c.staging.page_size,
                prefill_chunk=p.prefill.chunk, verify_width=p.verify.width, draft_width=p.draft.width,
                family=m.family, v4=V4Dims.from_model(m, c),
            )
        return cls(
            vocab=m.vocab_size, hidden=m.hidden_size, heads=m.num_heads, head_dim=m.head_dim,
            rope_dim=m.rope_head_dim, intermediate=m.intermediate_size,
            ratios=tuple(m.compress_ratios[: m.num_layers]), draft_stages=m.draft.stages,
            target_layer_ids=tuple(m.draft.target_layer_ids), noise_token_id=m.draft.noise_token_id,
            window=m.window, history=c.history, max_seq_len=m.max_seq_len, eps=m.rms_norm_eps,
            rope_theta=m.rope_theta, compress_rope_theta=m.compress_rope_theta,
            window_format=c.window_format, compressed_format=c.compressed_format,
            state_format=c.state_format, layout=c.staging.layout, page_size=c.staging.page_size,
            prefill_chunk=p.prefill.chunk, verify_width=p.verify.width, draft_width=p.draft.width,
        )

    @property
    def layers(self) -> int:
        return len(self.ratios)

    @property
    def window_row_bytes(self) -> int:
        return get_format(self.window_format).row_bytes(self.head_dim)

    @property
    def compressed_row_bytes(self) -> int:
        return get_format(self.compressed_format).row_bytes(self.head_dim)

    @property
    def state_row_bytes(self) -> int:
        # One [kv | score] row per token of the open group, in the state format.
        return get_format(self.state_format).row_bytes(2 * self.head_dim)

    def compressed_entries(self, ratio: int) -> int:
        return self.max_seq_len // ratio


@dataclass(frozen=True)
class V4Dims:
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    csa_ratio: int
    hca_ratio: int
    yarn: tuple | None  # (factor, original_max_position_embeddings, beta_fast, beta_slow)
    index_heads: int
    index_head_dim: int
    index_topk: int
    index_format: str
    hc_mult: int
    hc_iters: int
    hc_eps: float
    experts: int
    experts_per_token: int
    shared_experts: int
    hash_layers: int
    scoring: str
    routed_scaling: float
    swiglu_limit: float

    @classmethod
    def from_model(cls, m, c) -> "V4Dims":
        y = m.yarn
        return cls(
            q_lora_rank=m.q_lora_rank, o_groups=m.o_groups, o_lora_rank=m.o_lora_rank,
            csa_ratio=m.csa_ratio, hca_ratio=m.hca_ratio,
            yarn=None if y is None else (y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow),
            index_heads=m.indexer.heads, index_head_dim=m.indexer.head_dim, index_topk=m.indexer.topk,
            index_format=c.index_format, hc_mult=m.hyper_connections.mult,
            hc_iters=m.hyper_connections.sinkhorn_iters, hc_eps=m.hyper_connections.eps,
            experts=m.moe.experts, experts_per_token=m.moe.experts_per_token,
            shared_experts=m.moe.shared_experts, hash_layers=m.moe.hash_layers, scoring=m.moe.scoring,
            routed_scaling=m.moe.routed_scaling_factor, swiglu_limit=m.moe.swiglu_limit,
        )

    def kind(self, ratio: int) -> str:
        return {0: "window", self.csa_ratio: "csa", self.hca_ratio: "hca"}[ratio]
