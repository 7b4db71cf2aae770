"""DeepSeek V4 / V4.1 weights: names, shapes and dtypes, named as `transformers` names them.

Target weights carry DeepseekV4ForCausalLM's state-dict names
(`model.layers.3.self_attn.q_a_proj.weight`). Draft stages are stored under `mtp.{s}.`
with the decoder-layer names of a target layer; the V4 MTP stage adds its input
projections (`e_proj`, `h_proj`, `enorm`, `hnorm`), `hc_head` and `norm`; V4.1's DSpark
stages share `dspark.*`: the projection of the target's hidden states, the head, the
Markov bias and the confidence head. V4.1 layers own compressor weights only where their
CSA2 role owns caches (Full), and indexer queries where they rank (Full, Reindex).

Each weight is stored in the format the recipe gives its role (weight_roles.py; fp32
without a `weights` section). A block-scaled weight is two tensors: its data under the
weight's own name (float8_e4m3fn [.., out, in], or fp4 packed in int8 [.., out, in / 2])
and its scale under the name plus `_scale` (`...q_a_proj.weight_scale`,
`...experts.gate_up_proj_scale`; transformers calls it `weight_scale_inv`, DeepSeek's
release `<module>.scale`; either way the value multiplies the data).
"""

from __future__ import annotations

import math

import torch

from b12x_toolchain.exporter.model.engram import TOKEN_MAP, prefix, table_rows
from b12x_toolchain.exporter.model.engram_token_map import identity_token_map
from b12x_toolchain.exporter.model.weight_roles import WeightRole, weight_role
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.formats.weight_formats import WeightFormat, quantize_fp4, quantize_fp8_block

Spec = tuple[tuple[int, ...], str]  # (shape, dtype)
SCALE_SUFFIX = "_scale"
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _hc(d: Dims, prefix: str) -> dict[str, Spec]:
    D = d.hidden
    width = (2 + d.hc_mult) * d.hc_mult
    return {prefix + "fn": ((width, d.hc_mult * D), "float32"), prefix + "base": ((width,), "float32"),
            prefix + "scale": ((3,), "float32")}


def _compressor(d: Dims, prefix: str, ratio: int, dim: int, kind: str) -> dict[str, Spec]:
    width = 2 * dim if kind == "csa" else dim  # CSA pools two series (Ca | Cb) per token
    specs = {prefix + "kv_proj.weight": ((width, d.hidden), "float32"), prefix + "kv_norm.weight": ((dim,), "float32")}
    if kind != "direct":  # a ratio-1 entry is one token's row: nothing to gate
        specs[prefix + "gate_proj.weight"] = ((width, d.hidden), "float32")
    if kind in ("csa", "hca"):  # V4.1's pool has no position bias
        specs[prefix + "position_bias"] = ((ratio, width), "float32")
    return specs


def _index_queries(d: Dims, c: str) -> dict[str, Spec]:
    return {c + "q_b_proj.weight": ((d.index_heads * d.index_head_dim, d.q_lora_rank), "float32"),
            c + "scorer.weights_proj.weight": ((d.index_heads, d.hidden), "float32")}


def _compression(d: Dims, a: str, layer: int) -> dict[str, Spec]:
    ratio, kind, role = d.ratios[layer], d.kind(layer), d.role(layer)
    c = a + "compressor."
    specs = {}
    if role == "full":
        specs.update(_compressor(d, c, ratio, d.head_dim, kind))
    if kind == "csa":
        specs.update(_compressor(d, c + "indexer.", ratio, d.index_head_dim, kind))
        specs.update(_index_queries(d, c + "indexer."))
    elif not d.v4 and role == "full":  # V4.1 index keys come from the entries themselves
        specs[c + "indexer.k_proj.weight"] = ((d.index_head_dim, d.head_dim), "float32")
        specs[c + "indexer.k_norm.weight"] = ((d.index_head_dim,), "float32")
    if not d.v4 and role in ("full", "reindex"):
        specs.update(_index_queries(d, c + "indexer."))
    return specs


def _layer(d: Dims, prefix: str, layer: int | None, moe, hash_routed: bool) -> dict[str, Spec]:
    """One decoder layer; layer None is a draft stage (window only)."""
    D, H, hd = d.hidden, d.heads, d.head_dim
    a = prefix + "self_attn."
    specs = {
        prefix + "input_layernorm.weight": ((D,), "float32"),
        prefix + "post_attention_layernorm.weight": ((D,), "float32"),
        a + "q_a_proj.weight": ((d.q_lora_rank, D), "float32"),
        a + "q_a_norm.weight": ((d.q_lora_rank,), "float32"),
        a + "q_b_proj.weight": ((H * hd, d.q_lora_rank), "float32"),
        a + "kv_proj.weight": ((hd, D), "float32"),
        a + "kv_norm.weight": ((hd,), "float32"),
        a + "o_a_proj.weight": ((d.o_groups * d.o_lora_rank, H * hd // d.o_groups), "float32"),
        a + "o_b_proj.weight": ((D, d.o_groups * d.o_lora_rank), "float32"),
        a + "sinks": ((H,), "float32"),
    }
    specs.update(_hc(d, prefix + "attn_hc."))
    specs.update(_hc(d, prefix + "ffn_hc."))
    if layer is not None:
        specs.update(_compression(d, a, layer))
    m, E, I = prefix + "mlp.", moe.experts, moe.intermediate
    specs[m + "gate.weight"] = ((E, D), "float32")
    if hash_routed:
        specs[m + "gate.tid2eid"] = ((d.vocab, moe.experts_per_token), "int64")
    else:
        specs[m + "gate.e_score_correction_bias"] = ((E,), "float32")
    specs[m + "experts.gate_up_proj"] = ((E, 2 * I, D), "float32")
    specs[m + "experts.down_proj"] = ((E, D, I), "float32")
    if moe.shared_experts:
        for name, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            specs[f"{m}shared_experts.{name}.weight"] = (shape, "float32")
    return specs


def _head(d: Dims, prefix: str) -> dict[str, Spec]:
    D = d.hidden
    return {prefix + "hc_head.hc_fn": ((d.hc_mult, d.hc_mult * D), "float32"),
            prefix + "hc_head.hc_base": ((d.hc_mult,), "float32"),
            prefix + "hc_head.hc_scale": ((1,), "float32"),
            prefix + "norm.weight": ((D,), "float32")}


def logical_specs(d: Dims) -> dict[str, Spec]:
    """Every weight of the model, target and draft stages, as its logical float32 (or int64) tensor."""
    D = d.hidden
    specs = {EMBED: ((d.vocab, D), "float32"), LM_HEAD: ((d.vocab, D), "float32")}
    specs.update(_head(d, "model."))
    for i in range(d.layers):
        specs.update(_layer(d, f"model.layers.{i}.", i, d.moe, i < d.moe.hash_layers))
    for s in range(d.draft_stages):
        p = f"mtp.{s}."
        if d.v4:
            specs.update({p + "enorm.weight": ((D,), "float32"), p + "hnorm.weight": ((D,), "float32"),
                          p + "e_proj.weight": ((D, D), "float32"), p + "h_proj.weight": ((D, D), "float32")})
            specs.update(_head(d, p))
        specs.update(_layer(d, p, None, d.moe if d.v4 else d.draft_moe, hash_routed=False))
    if not d.v4:
        specs.update(_dspark(d))
    if d.engram is not None:
        specs.update(_engram(d))
    return specs


def _engram(d: Dims) -> dict[str, Spec]:
    """Per Engram layer: its table (a row per hash bucket of every head), the projection to a key
    per stream and one value, and the gate's two norm gains; one token map for all of them."""
    e, D = d.engram, d.hidden
    specs = {TOKEN_MAP: ((d.vocab,), "int64")}
    for layer, rows in table_rows(d).items():
        p = prefix(layer)
        specs.update({p + "embed.weight": ((rows, e.head_dim), "float32"),
                      p + "wkv.weight": (((d.hc_mult + 1) * D, e.columns * e.head_dim), "float32"),
                      p + "q_weight": ((d.hc_mult, D), "float32"), p + "k_weight": ((d.hc_mult, D), "float32")})
    return specs


def weight_roles(d: Dims) -> dict[str, WeightRole]:
    """Every weight's role and the format the recipe gives it (weight_roles.py)."""
    return {name: weight_role(name, d.role_format) for name in logical_specs(d)}


def weight_formats(d: Dims) -> dict[str, WeightFormat]:
    """The format of every weight whose role the recipe gives another format than fp32."""
    return {name: weight.format for name, weight in weight_roles(d).items() if weight.format.kind != "fp32"}


def weight_specs(d: Dims) -> dict[str, Spec]:
    """Every tensor the weights are stored as, sorted by name: a weight in its format, and the
    scale of a block-scaled one (see the module's docstring)."""
    specs, formats = logical_specs(d), weight_formats(d)
    out = {}
    for name, (shape, dtype) in specs.items():
        fmt = formats.get(name)
        if fmt is None:
            out[name] = (shape, dtype)
            continue
        out[name] = (fmt.data_shape(shape), fmt.data_dtype)
        if fmt.quantized:
            out[name + SCALE_SUFFIX] = (fmt.scale_shape(shape), fmt.scale_dtype)
    return dict(sorted(out.items()))


def _dspark(d: Dims) -> dict[str, Spec]:
    D, V, r = d.hidden, d.vocab, d.markov_rank
    specs = {"dspark.main_proj.weight": ((D, len(d.target_layer_ids) * D), "float32"),
             "dspark.main_norm.weight": ((D,), "float32"),
             "dspark.markov.embed": ((V, r), "float32"), "dspark.markov.out.weight": ((V, r), "float32"),
             "dspark.confidence.weight": ((1, D), "float32"), "dspark.confidence.bias": ((1,), "float32")}
    specs.update(_head(d, "dspark."))
    return specs


def init_weights(d: Dims, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """Random weights from `seed`, scaled so activations keep unit size through the layers.

    Unlike the `transformers` init (zero sinks and position biases, identity-like mHC),
    every tensor is non-trivial, so a test comparing against the reference exercises it.
    Drawn as float32 in name order whatever the formats, so a seed gives the same model in
    every format: a bf16 weight is rounded from its draw, a block-scaled one quantized from
    it (`quantize_stored`), one tensor at a time.
    """
    roles = weight_roles(d)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for name, (shape, dtype) in sorted(logical_specs(d).items()):
        weight = roles[name]
        tensor = _draw(d, name, shape, dtype, weight.role, gen)
        if weight.format.kind == "fp32":
            out[name] = tensor.to(device)
            continue
        data, scale = quantize_stored(tensor, weight.format)
        out[name] = data.to(device)
        if scale is not None:
            out[name + SCALE_SUFFIX] = scale.to(device)
    return dict(sorted(out.items()))


def _draw(d: Dims, name: str, shape, dtype: str, role: str | None, gen: torch.Generator) -> torch.Tensor:
    """One weight's random logical values, sized by what the weight is."""
    if name == TOKEN_MAP:  # random weights take the identity-style map
        return identity_token_map(shape[0], d.engram.compressed_vocab)
    if dtype == "int64":  # hash routing table: distinct experts per token
        ranks = torch.rand((shape[0], d.moe.experts), generator=gen).argsort(dim=-1)
        return ranks[:, : shape[1]].contiguous()
    if role == "norms" or name.endswith(("hc_scale", "_hc.scale")):  # gains: about one
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name == "dspark.markov.embed":
        return 0.1 * torch.randn(shape, generator=gen)
    if len(shape) == 1 or name.endswith("position_bias"):
        return 0.5 * torch.randn(shape, generator=gen)
    if role in ("embeddings", "engram_tables"):  # rows looked up, not multiplied: unit values
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / shape[-1] ** 0.5


def quantize_stored(tensor: torch.Tensor, fmt: WeightFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(data, scale or None): float weights `tensor` in format `fmt`, as weight_specs stores them.
    Leading axes (routed experts) are quantized one matrix at a time."""
    if fmt.kind == "fp4_e2m1":
        return quantize_fp4(tensor)
    if fmt.kind == "fp8_e4m3":
        if tensor.dim() == 2:
            return quantize_fp8_block(tensor, fmt.block, fmt.scale_encoding)
        pieces = [quantize_stored(matrix, fmt) for matrix in tensor.unbind(0)]
        return torch.stack([p[0] for p in pieces]), torch.stack([p[1] for p in pieces])
    return tensor.to(getattr(torch, fmt.data_dtype)), None


def weight_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, (shape, _) in weight_specs(d).items()}


def random_weight_bytes(d: Dims) -> int:
    """Bytes `init_weights(d, ...)` would allocate, from the shapes and dtypes alone.

    A full-size recipe's random weights take hundreds of GiB (dsv41: 175 GiB in its release
    formats, 1.2 TiB in fp32); export draws them all before capturing anything, so the caller
    checks this number against memory first instead of finding out in the allocator.
    """
    return sum(math.prod(shape) * getattr(torch, dtype).itemsize for shape, dtype in weight_specs(d).values())
