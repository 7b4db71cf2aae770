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

    @classmethod
    def from_recipe(cls, recipe) -> "Dims":
        m, c, p = recipe.model, recipe.cache, recipe.passes
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
