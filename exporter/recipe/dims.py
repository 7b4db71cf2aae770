"""Everything the pass modules need from a recipe, flattened into frozen objects."""

from __future__ import annotations

from dataclasses import dataclass

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.formats.weight_formats import FP32, WeightFormat


@dataclass(frozen=True)
class MoeDims:
    experts: int
    experts_per_token: int
    shared_experts: int
    intermediate: int
    hash_layers: int
    scoring: str
    routed_scaling: float
    swiglu_limit: float

    @classmethod
    def from_spec(cls, m) -> "MoeDims":
        return cls(m.experts, m.experts_per_token, m.shared_experts, m.intermediate_size, m.hash_layers,
                   m.scoring, m.routed_scaling_factor, m.swiglu_limit)


@dataclass(frozen=True)
class EngramDims:
    layer_ids: tuple[int, ...]
    max_ngram: int
    heads: int  # per order
    head_dim: int
    prime_start: int
    compressed_vocab: int
    pad_id: int
    token_map: str

    @property
    def columns(self) -> int:
        return (self.max_ngram - 1) * self.heads

    @classmethod
    def from_spec(cls, e) -> "EngramDims":
        return cls(tuple(e.layer_ids), e.max_ngram, e.heads_per_order, e.head_dim, e.prime_search_start,
                   e.compressed_vocab_size, e.pad_id, e.token_map)


@dataclass(frozen=True)
class Dims:
    family: str
    vocab: int
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    ratios: tuple[int, ...]  # per target layer: 0 window-only, else the compress ratio
    draft_stages: int
    window: int
    history: int
    max_seq_len: int
    eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: tuple | None  # (factor, original_max_position_embeddings, beta_fast, beta_slow)
    window_format: str
    compressed_format: str
    state_format: str
    index_format: str
    layout: str
    page_size: int
    entry_page_tokens: int  # tokens per page of the paged caches: compressed entries
    index_page_tokens: int  # and index keys
    prefill_chunk: int
    verify_width: int
    draft_width: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_iters: int
    hc_eps: float
    moe: MoeDims
    # V4: the two compressed kinds' ratios. V4.1: CSA2 roles and DSpark.
    csa_ratio: int = 0
    hca_ratio: int = 0
    roles: tuple[str, ...] = ()  # per target layer: window, full, reindex or reuse
    kv_source: tuple[int, ...] = ()  # per target layer: the layer whose entries it reads (-1: none)
    index_source: tuple[int, ...] = ()  # per target layer: the layer whose top-k it uses (-1: none)
    candidate_source: int = -1
    candidate_blocks: int = 0
    candidate_block_size: int = 1
    target_layer_ids: tuple[int, ...] = ()
    noise_token_id: int = 0
    markov_rank: int = 0
    confidence_threshold: float = 0.0
    draft_moe: MoeDims | None = None
    engram: EngramDims | None = None  # V4.1's n-gram memory layers (None: none)
    # The parallel mapping (exporter/recipe/parallel.py); 1, 1 on one device.
    tensor: int = 1
    expert: int = 1
    # The recipe's `weights` section: role -> format of the roles not in fp32, and the activation rule.
    role_formats: tuple[tuple[str, WeightFormat], ...] = ()
    activation: str = "none"

    def role_format(self, role: str | None) -> WeightFormat:
        """The format of a weight role (None: a weight whose format is fixed, fp32 or int64)."""
        return dict(self.role_formats).get(role, FP32)

    @classmethod
    def from_recipe(cls, recipe) -> "Dims":
        m, c, p = recipe.model, recipe.cache, recipe.passes
        y = m.yarn
        common = dict(
            family=m.family, vocab=m.vocab_size, hidden=m.hidden_size, heads=m.num_heads, head_dim=m.head_dim,
            rope_dim=m.rope_head_dim, ratios=tuple(m.target_ratios), draft_stages=m.draft.stages,
            window=m.window, history=c.history, max_seq_len=m.max_seq_len, eps=m.rms_norm_eps,
            rope_theta=m.rope_theta, compress_rope_theta=m.compress_rope_theta,
            yarn=None if y is None else (y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow),
            window_format=c.window_format, compressed_format=c.compressed_format, state_format=c.state_format,
            index_format=c.index_format, layout=c.staging.layout, page_size=c.staging.page_size,
            entry_page_tokens=c.pages.compressed_entries, index_page_tokens=c.pages.index_keys,
            prefill_chunk=p.prefill.chunk, verify_width=p.verify.width, draft_width=p.draft.width,
            q_lora_rank=m.q_lora_rank, o_groups=m.o_groups, o_lora_rank=m.o_lora_rank,
            index_heads=m.indexer.heads, index_head_dim=m.indexer.head_dim, index_topk=m.indexer.topk,
            hc_mult=m.hyper_connections.mult, hc_iters=m.hyper_connections.sinkhorn_iters,
            hc_eps=m.hyper_connections.eps, moe=MoeDims.from_spec(m.moe),
        )
        if recipe.parallel is not None:
            common.update(tensor=recipe.parallel.tensor, expert=recipe.parallel.expert)
        if recipe.weights is not None:
            formats = recipe.weights.formats()
            common.update(role_formats=tuple((r, f) for r, f in formats.items() if f != FP32),
                          activation=recipe.weights.activation)
        if m.family == "deepseek_v4":
            return cls(**common, csa_ratio=m.csa_ratio, hca_ratio=m.hca_ratio)
        roles, kv_source, index_source = _csa2_roles(m.target_ratios, m.csa2)
        cs = m.csa2
        return cls(**common, roles=roles, kv_source=kv_source, index_source=index_source,
                   candidate_source=-1 if cs.candidate_source_layer_id is None else cs.candidate_source_layer_id,
                   candidate_blocks=cs.candidate_topk_blocks, candidate_block_size=cs.candidate_block_size,
                   target_layer_ids=tuple(m.draft.target_layer_ids), noise_token_id=m.draft.noise_token_id,
                   markov_rank=m.draft.markov_rank, confidence_threshold=m.draft.confidence_threshold,
                   draft_moe=MoeDims.from_spec(m.draft.moe),
                   engram=None if m.engram is None else EngramDims.from_spec(m.engram))

    @property
    def v4(self) -> bool:
        return self.family == "deepseek_v4"

    @property
    def world_size(self) -> int:
        return max(self.tensor, self.expert)

    @property
    def layers(self) -> int:
        return len(self.ratios)

    def kind(self, layer: int) -> str:
        """window, csa or hca (V4); window, pool (ratio 2) or direct (ratio 1) (V4.1)."""
        ratio = self.ratios[layer]
        if not ratio:
            return "window"
        if self.v4:
            return "csa" if ratio == self.csa_ratio else "hca"
        return "pool" if ratio == 2 else "direct"

    def role(self, layer: int) -> str:
        """Which compressed caches a layer owns: full (its own), reindex / reuse (none)."""
        if self.v4:
            return "full" if self.ratios[layer] else "window"
        return self.roles[layer]

    @property
    def window_row_bytes(self) -> int:
        return get_format(self.window_format).row_bytes(self.head_dim)


def _csa2_roles(ratios, csa2):
    roles, kv_source, index_source = [], [], []
    for layer, ratio in enumerate(ratios):
        if not ratio:
            roles.append("window"), kv_source.append(-1), index_source.append(-1)
            continue
        source = max(s for s in csa2.kv_source_layer_ids if s <= layer)
        indexers = [s for s in csa2.index_source_layer_ids if source <= s <= layer]
        roles.append("full" if layer == source else "reindex" if layer in indexers else "reuse")
        kv_source.append(source)
        index_source.append(max(indexers))
    return tuple(roles), tuple(kv_source), tuple(index_source)
