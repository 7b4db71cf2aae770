"""The `model` section of a recipe: DeepSeek V4 and V4.1, on one shared base.

Both families share the V4 block (latent MQA with q LoRA, sink and grouped output,
partial RoPE, mHC, hash / routed MoE); they differ in their compressors and drafters:
V4 has CSA (overlapping ratio-4 pool + lightning indexer) and HCA layers and an MTP
stage; V4.1 has ratio-2 / ratio-1 compressors shared across layers (CSA2: Full, Reindex
and Reuse roles, hierarchical candidates) and DSpark draft stages.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, Strict, model_validator

from b12x_toolchain.exporter.recipe.field_types import (
    NonNegInt,
    PosFloat,
    PosInt,
    Ratio,
    _check,
    _problem,
    _Spec,
    _unique,
)

Ids = Annotated[tuple[NonNegInt, ...], Field(min_length=1), AfterValidator(_unique)]
Even = Annotated[PosInt, _check(lambda v: v % 2 == 0, "even (RoPE rotates pairs)")]


class YarnSpec(_Spec):
    """YaRN scaling of the compress RoPE (DeepSeek V4: factor 16; cos/sin are not rescaled)."""

    factor: PosFloat
    original_max_position_embeddings: PosInt
    beta_fast: PosFloat = 32.0
    beta_slow: PosFloat = 1.0


class IndexerSpec(_Spec):
    """The lightning indexer: scores compressed entries per query, keeps the top `topk`."""

    heads: PosInt
    head_dim: Even
    topk: PosInt


class HyperConnectionSpec(_Spec):
    """Manifold-constrained hyper-connections: `mult` residual streams, Sinkhorn-projected mixing."""

    mult: PosInt
    sinkhorn_iters: PosInt
    eps: PosFloat


class MoeSpec(_Spec):
    experts: PosInt
    experts_per_token: PosInt
    shared_experts: Annotated[int, Strict(), Field(ge=0, le=1)]
    intermediate_size: PosInt
    hash_layers: NonNegInt = 0  # the first `hash_layers` layers route by a token-id table
    scoring: Literal["sqrtsoftplus", "sigmoid", "softmax"]
    routed_scaling_factor: PosFloat
    swiglu_limit: PosFloat

    @model_validator(mode="after")
    def _top_k(self) -> MoeSpec:
        if self.experts_per_token > self.experts:
            raise _problem(f"{self.experts_per_token} is more than experts = {self.experts}", ("experts_per_token",))
        return self


class _DeepSeek(_Spec):
    vocab_size: PosInt
    hidden_size: PosInt
    num_layers: PosInt
    num_heads: PosInt
    head_dim: Annotated[PosInt, _check(lambda v: v % 32 == 0, "a multiple of 32")]  # 32-element scale blocks
    rope_head_dim: Even
    q_lora_rank: PosInt
    o_groups: PosInt
    o_lora_rank: PosInt
    window: PosInt
    max_seq_len: PosInt
    rms_norm_eps: PosFloat
    rope_theta: PosFloat
    compress_rope_theta: PosFloat
    yarn: YarnSpec | None = None
    indexer: IndexerSpec
    hyper_connections: HyperConnectionSpec
    moe: MoeSpec
    init_seed: NonNegInt

    @property
    def target_ratios(self) -> tuple[int, ...]:
        """Compression ratio of each target layer (the draft stages' entries dropped)."""
        return self.compress_ratios[: self.num_layers]

    def _shared_checks(self, compressed_ratios) -> None:
        if self.rope_head_dim > self.head_dim:
            raise _problem(f"{self.rope_head_dim} is larger than head_dim {self.head_dim}", ("rope_head_dim",))
        if self.rope_head_dim > self.indexer.head_dim:
            raise _problem(f"{self.indexer.head_dim} is smaller than rope_head_dim {self.rope_head_dim}",
                           ("indexer", "head_dim"))
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise _problem(f"{self.o_groups} does not divide num_heads * head_dim = "
                           f"{self.num_heads * self.head_dim}", ("o_groups",))
        if self.moe.hash_layers > self.num_layers:
            raise _problem(f"{self.moe.hash_layers} is more than num_layers = {self.num_layers}", ("moe", "hash_layers"))
        expected = self.num_layers + self.draft.stages
        if len(self.compress_ratios) != expected:
            raise _problem(f"has {len(self.compress_ratios)} entries; expected num_layers + draft.stages"
                           f" = {expected}", ("compress_ratios",))
        for i in range(self.num_layers, expected):
            if self.compress_ratios[i] != 0:
                raise _problem(f"draft stage entry is {self.compress_ratios[i]}; draft stages use the window"
                               " only, so it must be 0", ("compress_ratios", i))
        for ratio in compressed_ratios:
            if self.max_seq_len % ratio:
                raise _problem(f"{self.max_seq_len} is not a multiple of compress ratio {ratio}", ("max_seq_len",))

    def _check_layer_ids(self, ids, key) -> None:
        for i, layer in enumerate(ids):
            if layer >= self.num_layers:
                raise _problem(f"layer {layer} is out of range; expected 0 <= id < num_layers"
                               f" = {self.num_layers}", (*key, i))


# --- DeepSeek V4 ------------------------------------------------------------------------

class MtpSpec(_Spec):
    """Multi-token prediction: a window-only V4 block fed with the target's streams and the
    next token's embedding; drafts are chained one token at a time."""

    stages: Annotated[int, Strict(), Literal[1]]


class V4ModelSpec(_DeepSeek):
    """DeepSeek V4 as Hugging Face `transformers` implements it (DeepseekV4ForCausalLM)."""

    family: Literal["deepseek_v4"]
    # Per target layer, then per MTP stage: 0 window only, csa_ratio (CSA), hca_ratio (HCA).
    compress_ratios: tuple[Annotated[int, Strict(), Field(ge=0)], ...]
    csa_ratio: PosInt
    hca_ratio: PosInt
    draft: MtpSpec

    @model_validator(mode="after")
    def _cross_checks(self) -> V4ModelSpec:
        self._shared_checks((self.csa_ratio, self.hca_ratio))
        if self.csa_ratio == self.hca_ratio:
            raise _problem(f"{self.hca_ratio} equals csa_ratio; the two compressed layer kinds need distinct "
                           "ratios", ("hca_ratio",))
        for i, ratio in enumerate(self.target_ratios):
            if ratio not in (0, self.csa_ratio, self.hca_ratio):
                raise _problem(f"{ratio} is not 0, csa_ratio {self.csa_ratio} or hca_ratio {self.hca_ratio}",
                               ("compress_ratios", i))
        return self


# --- DeepSeek V4.1 ----------------------------------------------------------------------

class Csa2Spec(_Spec):
    """Compressed-cache sharing. Full layers (kv sources) own a compressor, compressed entries
    and index keys; Reindex layers (index sources that are not kv sources) score those keys
    with their own queries and publish a new top-k; every other compressed layer is a Reuse
    layer, taking the latest sources' entries and top-k unchanged. From the candidate
    source on, indexers sharing its keys search only its top blocks of entries."""

    kv_source_layer_ids: Ids
    index_source_layer_ids: Ids
    candidate_source_layer_id: NonNegInt | None = None
    candidate_topk_blocks: PosInt = 1
    candidate_block_size: PosInt = 1


class DSparkSpec(_Spec):
    """DSpark drafting: window-only stages over a block [anchor, noise...], non-causal inside
    the block, fed with the projected hidden states of `target_layer_ids`."""

    stages: PosInt
    target_layer_ids: Ids
    noise_token_id: NonNegInt
    markov_rank: PosInt  # low-rank bias on each row's logits from the previous row's token
    # A row whose confidence (sigmoid head) is below this ends the block; 0 keeps every row.
    confidence_threshold: Annotated[float, Strict(), Field(ge=0, lt=1)] = 0.0
    moe: MoeSpec


class EngramSpec(_Spec):
    """Engram: before each listed layer, the token's 2- to `max_ngram`-grams of compressed
    token ids are hashed by `heads_per_order` heads per order into rows of the layer's table;
    the rows, projected and gated, are added to every hyper-connection stream.

    Each head's table has a prime row count: consecutive primes from `prime_search_start`,
    layer by layer, order by order, head by head (exporter/model/engram_hashing.py). The
    table's storage format is the `engram_tables` role of the `weights` section, as every
    weight's format is. `token_map` says how token ids become compressed ids: `identity`
    (id mod compressed_vocab_size) or `tokenizer` (derived from the checkpoint's
    tokenizer.json as DeepSeek's reference normalises it: exporter/model/engram_token_map.py).
    """

    layer_ids: Ids
    max_ngram: Annotated[int, Strict(), Field(ge=2)]
    heads_per_order: PosInt
    head_dim: Annotated[PosInt, _check(lambda v: v % 32 == 0, "a multiple of 32")]  # 32-value table scale blocks
    prime_search_start: Annotated[int, Strict(), Field(ge=2)]
    compressed_vocab_size: PosInt
    pad_id: NonNegInt
    token_map: Literal["identity", "tokenizer"] = "identity"

    @model_validator(mode="after")
    def _pad_in_vocab(self) -> EngramSpec:
        if self.pad_id >= self.compressed_vocab_size:
            raise _problem(f"{self.pad_id} is out of range; expected < compressed_vocab_size"
                           f" = {self.compressed_vocab_size}", ("pad_id",))
        return self

    @property
    def columns(self) -> int:
        """Hash columns (and table heads) per layer: (max_ngram - 1) orders x heads_per_order."""
        return (self.max_ngram - 1) * self.heads_per_order


class V41ModelSpec(_DeepSeek):
    """DeepSeek V4.1 (Flash): ratio-2 and ratio-1 compressors shared across layers, DSpark, Engram."""

    family: Literal["deepseek_v41"]
    compress_ratios: tuple[Ratio, ...]  # per target layer, then 0 per draft stage
    csa2: Csa2Spec
    draft: DSparkSpec
    engram: EngramSpec | None = None

    @model_validator(mode="after")
    def _cross_checks(self) -> V41ModelSpec:
        self._shared_checks(sorted(set(self.compress_ratios) - {0}))
        self._check_layer_ids(self.draft.target_layer_ids, ("draft", "target_layer_ids"))
        if self.draft.noise_token_id >= self.vocab_size:
            raise _problem(f"{self.draft.noise_token_id} is out of range; expected < vocab_size"
                           f" = {self.vocab_size}", ("draft", "noise_token_id"))
        if self.draft.moe.hash_layers:
            raise _problem("draft stages route by score; hash routing needs a target layer", ("draft", "moe", "hash_layers"))
        self._check_roles()
        if self.engram is not None:
            self._check_layer_ids(self.engram.layer_ids, ("engram", "layer_ids"))
            if list(self.engram.layer_ids) != sorted(self.engram.layer_ids):
                raise _problem(f"{list(self.engram.layer_ids)} is not in increasing order", ("engram", "layer_ids"))
            if self.engram.compressed_vocab_size > self.vocab_size:
                raise _problem(f"{self.engram.compressed_vocab_size} is more than vocab_size = {self.vocab_size}; "
                               "compression maps token ids onto at most as many ids", ("engram", "compressed_vocab_size"))
        return self

    def _check_roles(self) -> None:
        c, ratios = self.csa2, self.target_ratios
        key = ("csa2", "kv_source_layer_ids")
        self._check_layer_ids(c.kv_source_layer_ids, key)
        self._check_layer_ids(c.index_source_layer_ids, ("csa2", "index_source_layer_ids"))
        for i, layer in enumerate(c.kv_source_layer_ids):
            if ratios[layer] == 0:
                raise _problem(f"layer {layer} is window-only; a kv source must be a compressed layer", (*key, i))
        for layer, ratio in enumerate(ratios):
            if not ratio:
                continue
            sources = [s for s in c.kv_source_layer_ids if s <= layer]
            if not sources:
                raise _problem(f"compressed layer {layer} has no kv source at or before it", key)
            if ratios[sources[-1]] != ratio:
                raise _problem(f"layer {layer} (ratio {ratio}) would reuse layer {sources[-1]} "
                               f"(ratio {ratios[sources[-1]]}); a layer reuses entries of its own ratio", key)
        for i, layer in enumerate(c.index_source_layer_ids):
            if ratios[layer] == 0:
                raise _problem(f"layer {layer} is window-only; an index source must be a compressed layer",
                               ("csa2", "index_source_layer_ids", i))
        for layer in c.kv_source_layer_ids:
            if layer not in c.index_source_layer_ids:
                raise _problem(f"kv source {layer} is missing; a Full layer indexes its own keys",
                               ("csa2", "index_source_layer_ids"))
        if c.candidate_source_layer_id is not None and c.candidate_source_layer_id not in c.index_source_layer_ids:
            raise _problem(f"layer {c.candidate_source_layer_id} is not an index source",
                           ("csa2", "candidate_source_layer_id"))
