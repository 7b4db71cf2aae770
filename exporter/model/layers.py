"""The DeepSeek V4 / V4.1 decoder layer over b12x cache ops.

Layer compute follows `transformers`' DeepseekV4ForCausalLM. Where rows live is b12x's:
the window and compressor state are rings addressed by absolute position, compressed
entries are written as their group closes, and verify writes staging that commit makes
persistent. Compressed layers differ by kind (V4: CSA, HCA; V4.1: ratio-2 pool, ratio-1
direct) and, in V4.1, by CSA2 role: a Full layer compresses and indexes, a Reindex layer
ranks its source's keys with its own queries, a Reuse layer takes both unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from b12x_toolchain.exporter.model import buffer_names
from b12x_toolchain.exporter.model.blocks import (
    grouped_out,
    hc_head,
    hc_merge,
    hc_mix,
    inv_freq,
    moe,
    pool,
    rms_norm,
    rope,
    rope_angles,
    unit_rms_norm,
)
from b12x_toolchain.exporter.model.buffers import owned_caches
from b12x_toolchain.exporter.model.cache_io import _before
from b12x_toolchain.exporter.model.linears import Linears, as_float32
from b12x_toolchain.exporter.model.parallel import Mesh
from b12x_toolchain.runtime.ops.opset import ops
from b12x_toolchain.runtime.package.kinds import KINDS

ENTRY_POOL, INDEX_POOL = KINDS["compressed_entries"].pool, KINDS["index_keys"].pool
FFN_PARTS = ("ffn_hc.", "post_attention_layernorm.", "mlp.")  # a layer's weights read by its MoE half
# What a layer reads of earlier layers' hand-overs, by role, as (hand-over, link): what
# `compressed_keys` reads, where it is there. A capture refuses a layer that reads more.
READS = {
    "window": (),
    "full": (("candidates", "kv"),),
    "reindex": (("keys", "kv"), ("index_keys", "kv"), ("candidates", "kv")),
    "reuse": (("keys", "kv"), ("chosen", "index")),
}


class Shared:
    """What compressed layers hand on within one pass: entries by kv source, choices by index source,
    RoPE tables by ratio."""

    HANDOVERS = ("keys", "index_keys", "candidates", "chosen")  # by layer; what a layer may read or write

    def __init__(self):
        self.keys, self.index_keys, self.candidates, self.chosen = {}, {}, {}, {}
        self.starts = {}  # compress ratio -> the RoPE at each pass row's group start

    def entries(self) -> dict:
        """(hand-over, layer) -> value, as things stand."""
        return {(name, layer): value for name in self.HANDOVERS for layer, value in getattr(self, name).items()}


@dataclass(frozen=True)
class Entries:
    """The compressed entries a layer attends to: where they live, and which (None: all it may see)."""

    cache: torch.Tensor
    new: torch.Tensor
    block_table: torch.Tensor
    positions: torch.Tensor
    indices: Optional[torch.Tensor]
    ratio: int
    fmt: str


class DeepSeekCompute(torch.nn.Module):
    def __init__(self, d, rank: int = 0):
        super().__init__()
        self.d = d
        self.mesh = Mesh.of(d, rank)
        self.linear = Linears(d)  # linear(w, name, x): x by a weight in its stored format
        self.copies = None  # a LayerCopies while a capture copies repeated layers instead of tracing them

    # -- positions ----------------------------------------------------------------------

    def angles(self, pos):
        """The main RoPE at `pos` (window-only layers and the draft stages)."""
        d = self.d
        return rope_angles(pos, inv_freq(d.rope_theta, d.rope_dim, None, pos.device))

    def compress_angles(self, pos):
        """The compress RoPE (YaRN) at `pos` (compressed layers and their indexers)."""
        return rope_angles(pos, self.compress_freqs(pos.device))

    def compress_freqs(self, device):
        return inv_freq(self.d.compress_rope_theta, self.d.rope_dim, self.d.yarn, device)

    # -- one layer -------------------------------------------------------------------------

    def layer(self, w, p, streams, tokens, pos, angles, window_keys, visible, moe_dims, compressed=None):
        """Attention then MoE on the streams [R,T,N,D], each through mHC."""
        streams = self.attention(w, p, streams, pos, angles, window_keys, visible, compressed)
        return self.ffn(w, p, streams, tokens, moe_dims)

    def visible(self, pos, key_pos, *, min_pos=0, block_from=None):
        """[R, T, S]: the keys at `key_pos` [R, S] each query row at `pos` [R, T] sees. Keys from
        index `block_from` on are a non-causal block (DSpark), visible to every row of it.
        The same for every layer of a pass, so a pass builds it once."""
        d = self.d
        kp, qp = key_pos[:, None, :], pos[:, :, None]
        ordered = kp <= qp
        if block_from is not None:
            ordered = ordered | (torch.arange(key_pos.shape[1], device=pos.device) >= block_from)[None, None, :]
        return (kp > qp - d.window) & (kp >= min_pos) & ordered

    def attention(self, w, p, streams, pos, angles, window_keys, visible, compressed=None):
        """The attention half of a layer, through mHC; window_keys(kv) -> the keys `visible` masks."""
        d = self.d
        R, T = pos.shape
        post, comb, collapsed = hc_mix(w, p + "attn_hc.", streams, d.hc_iters, d.hc_eps, d.eps)
        x = rms_norm(collapsed, w[p + "input_layernorm.weight"], d.eps)
        a = p + "self_attn."
        linear = self.linear
        q_res = rms_norm(linear(w, a + "q_a_proj.weight", x), w[a + "q_a_norm.weight"], d.eps)
        q = linear(w, a + "q_b_proj.weight", q_res).view(R, T, d.heads // d.tensor, d.head_dim)  # this rank's heads
        if d.v4:  # V4 normalises each query head; V4.1 does not
            q = unit_rms_norm(q, d.eps)
        q = rope(q, angles.heads())
        kv = rope(rms_norm(linear(w, a + "kv_proj.weight", x), w[a + "kv_norm.weight"], d.eps), angles)
        keys = window_keys(kv)
        if compressed is None:  # window only; the block table and positions are not read without entries
            out = ops.sparse_attention(q, keys, visible, w[a + "sinks"], None, None, pos[:, 0], pos[:, 0], None, 1, "fp32")
        else:
            e = compressed(x, q_res)
            out = ops.sparse_attention(q, keys, visible, w[a + "sinks"], e.cache, e.new, e.block_table, e.positions,
                                       e.indices, e.ratio, e.fmt)
        out = rope(out, angles.heads().inverse())  # K = V carried RoPE into the output
        out = self.mesh.tensor_sum(grouped_out(w, a, out.flatten(2), d.o_groups // d.tensor, linear))  # row-parallel O
        return hc_merge(post, comb, out, streams)

    def ffn(self, w, p, streams, tokens, moe_dims):
        """The MoE half of a layer, through mHC; while capturing with copies, traced once per
        kind of MoE (hash or routed, and its dimensions) and copied for the others."""
        d = self.d

        def body(streams):
            post, comb, collapsed = hc_mix(w, p + "ffn_hc.", streams, d.hc_iters, d.hc_eps, d.eps)
            y = moe(w, p + "mlp.", rms_norm(collapsed, w[p + "post_attention_layernorm.weight"], d.eps), tokens,
                    moe_dims, self.linear, self.mesh)
            return hc_merge(post, comb, y, streams)

        if self.copies is None:
            return body(streams)
        names, own = self.own_buffers(w, None, p, [], ffn=True)
        # The tokens are an input: a draft step's differ from the step before (hash routing reads them).
        outputs, _ = self.copies.run(("ffn", repr(moe_dims), tuple(names)), [streams, tokens, *own],
                                     lambda: ([body(streams)], None))
        return outputs[0]

    def logits(self, w, p, streams):
        d = self.d
        h = rms_norm(hc_head(w, p, streams, d.hc_eps, d.eps), w[p + "norm.weight"], d.eps)
        return self.mesh.gather_last(self.linear(w, "lm_head.weight", h)), h

    def embed(self, w, tokens):
        # A bf16 table's rows are widened after the lookup: the table itself never is.
        return as_float32(self.mesh.embed(tokens, w["model.embed_tokens.weight"]))

    # -- a target layer, traced once per kind while capturing -----------------------------

    def links(self, i: int) -> dict[str, int]:
        """The layers whose hand-overs layer i reads or writes, by relation."""
        d = self.d
        return {"self": i} if d.v4 else {"self": i, "kv": d.kv_source[i], "index": d.index_source[i]}

    def layer_key(self, i: int) -> tuple:
        """Everything layer i's code branches on besides its buffers and hand-overs."""
        d = self.d
        return d.ratios[i], d.kind(i), d.role(i), i > d.candidate_source, i == d.candidate_source

    @staticmethod
    def own_buffers(w, io, prefix: str, caches: list[str], ffn: bool) -> tuple[list[str], list[torch.Tensor]]:
        """A half layer's own weights (by name below the layer's prefix; the MoE half's or the
        rest) and cache buffers, in a fixed order."""
        names = sorted(name for name in w if name.startswith(prefix) and not name[len(prefix):].startswith("engram.")
                       and name[len(prefix):].startswith(FFN_PARTS) == ffn)  # Engram runs before the layer
        tensors = [w[name] for name in names] + [t for cache in caches for t in io.owned(cache)]
        return [name[len(prefix):] for name in names], tensors

    def run_stage(self, s, w, io, streams, body):
        """body(streams) -> draft stage s's attention half; while capturing with copies, traced
        for the first stage only (the stages differ in weights and window ring alone)."""
        if self.copies is None:
            return body(streams)
        names, own = self.own_buffers(w, io, f"mtp.{s}.", [buffer_names.window(buffer_names.stage(s))], ffn=False)
        outputs, _ = self.copies.run(("draft stage", tuple(names)), [streams, *own], lambda: ([body(streams)], None))
        return outputs[0]

    def run_layer(self, i, w, io, shared: Shared, streams, body):
        """body(streams) -> target layer i's attention half. While capturing with copies, the body
        is traced for the first layer of its kind only; every hand-over it reads and writes is an
        input or an output, named by relation so that a copy finds its own."""
        if self.copies is None:
            return body(streams)
        links = self.links(i)
        entries = shared.entries()
        reads = [(name, rel) for name, rel in READS[self.d.role(i)] if rel in links and (name, links[rel]) in entries]
        read_values = [entries[(name, links[rel])] for name, rel in reads]
        names, own = self.own_buffers(w, io, f"model.layers.{i}.", [c.name for c in owned_caches(self.d, i)], ffn=False)
        key = (self.layer_key(i), tuple(reads), tuple(map(_arity, read_values)), tuple(names))

        def traced():
            out = body(streams)
            writes = [(name, layer, value) for (name, layer), value in shared.entries().items()
                      if entries.get((name, layer)) is not value]
            note = [(name, _relation(links, layer, i), _arity(value)) for name, layer, value in writes]
            return [out, *_flat(value for *_, value in writes)], note

        outputs, note = self.copies.run(key, [streams, *_flat(read_values), *own], traced)
        rest = iter(outputs[1:])
        for name, rel, arity in note:
            getattr(shared, name)[links[rel]] = tuple(next(rest) for _ in range(arity)) if arity else next(rest)
        return outputs[0]

    # -- compressed entries -----------------------------------------------------------------

    def pooled(self, w, c, name, ratio, dim, kind, x, pos, io):
        """The normalised latent of the group closing at each position (before RoPE)."""
        d = self.d
        if kind == "direct":
            return rms_norm(self.linear(w, c + "kv_proj.weight", x), w[c + "kv_norm.weight"], d.eps)
        overlap = kind == "csa"
        width = 2 * dim if overlap else dim
        rows = torch.cat([self.linear(w, c + "kv_proj.weight", x), self.linear(w, c + "gate_proj.weight", x)], dim=-1)
        span = 2 * ratio if overlap else ratio
        prev = io.state(name, span, rows)
        positions = torch.cat([_before(io.positions, span - 1), pos], dim=1)
        bias = w.get(c + "position_bias")
        if bias is None:
            bias = torch.zeros(ratio, width, device=x.device)
        pooled = pool(torch.cat([prev, rows], dim=1), positions, ratio, width, bias, overlap)
        return rms_norm(pooled, w[c + "kv_norm.weight"], d.eps)

    def entries(self, io, caches, name, values, ratio, fmt, pool):
        """Write (prefill) or stage (verify) this pass's entries: (stored cache, this pass's as read back)."""
        return caches[buffer_names.cache(name)], io.entries(name, values, ratio, fmt, io.block_tables[pool])

    def compressed_keys(self, w, i, io, caches, row_ids, pos, shared, compress):
        """attach(x, q_res) -> Entries layer i attends to, by kind and role."""
        d = self.d
        ratio, kind, role = d.ratios[i], d.kind(i), d.role(i)
        c = f"model.layers.{i}.self_attn.compressor."
        source = i if d.v4 else d.kv_source[i]
        if ratio not in shared.starts:  # an entry sits at its group start; one table per ratio and pass
            shared.starts[ratio] = rope_angles(pos - (ratio - 1), self.compress_freqs(pos.device))
        start = shared.starts[ratio]

        def buffer(kind: str) -> str:
            return buffer_names.local(kind, buffer_names.layer(i))

        def attach(x, q_res):
            if role == "full":
                latent = self.pooled(w, c, buffer("compressor_state"), ratio, d.head_dim, kind, x, pos, io)
                shared.keys[i] = self.entries(io, caches, buffer("compressed_entries"), rope(latent, start), ratio,
                                              d.compressed_format, ENTRY_POOL)
                if kind == "csa":  # V4: the indexer pools its own keys
                    pooled = self.pooled(w, c + "indexer.", buffer("index_compressor_state"), ratio, d.index_head_dim, kind, x,
                                         pos, io)
                    index_keys = rope(pooled, start)
                elif not d.v4:  # V4.1: index keys are a projection of the entry's latent
                    ic = c + "indexer."
                    index_keys = rope(rms_norm(self.linear(w, ic + "k_proj.weight", latent), w[ic + "k_norm.weight"],
                                               d.eps),
                                      start)
                else:
                    index_keys = None
                if index_keys is not None:
                    shared.index_keys[i] = self.entries(io, caches, buffer("index_keys"), index_keys, ratio, d.index_format,
                                                        INDEX_POOL)
            if (d.v4 and kind == "csa") or (not d.v4 and role in ("full", "reindex")):
                shared.chosen[i] = self.indexer(w, c + "indexer.", i, source, x, q_res, pos, io.block_tables[INDEX_POOL],
                                                shared, compress, ratio)
            chooser = i if d.v4 else d.index_source[i]
            cache, new = shared.keys[source]
            return Entries(cache, new, io.block_tables[ENTRY_POOL], pos[:, 0], shared.chosen.get(chooser), ratio,
                           d.compressed_format)
        return attach

    def indexer(self, w, c, layer, source, x, q_res, pos, block_table, shared, compress, ratio):
        """The lightning indexer's choice: ids of the top-k entries by its score, [R, T, topk].

        The candidate source layer also picks the hierarchical candidate blocks that later
        indexers of its keys search within.
        """
        d = self.d
        R, T = pos.shape
        q = self.linear(w, c + "q_b_proj.weight", q_res).view(R, T, d.index_heads, d.index_head_dim)
        q = rope(q, compress.heads())
        head_weights = self.linear(w, c + "scorer.weights_proj.weight", x) * d.index_heads ** -0.5
        index_cache, new_keys = shared.index_keys[source]
        keys = (q, head_weights, index_cache, new_keys, block_table, pos[:, 0])
        candidates = shared.candidates.get(source) if layer > d.candidate_source else None
        if layer == d.candidate_source:
            shared.candidates[source] = ops.candidate_blocks(*keys, ratio, d.candidate_block_size, d.candidate_blocks,
                                                             d.index_format)
        return ops.indexer_topk(*keys, candidates, ratio, d.candidate_block_size, d.index_topk, d.index_format)


def _arity(value) -> int:
    """0 for a tensor, the length for a tuple of tensors."""
    return len(value) if isinstance(value, tuple) else 0


def _flat(values) -> list[torch.Tensor]:
    return [t for value in values for t in (value if isinstance(value, tuple) else (value,))]


def _relation(links: dict, layer: int, i: int) -> str:
    for rel, linked in links.items():
        if linked == layer:
            return rel
    raise ValueError(f"layer {i} hands on an entry of layer {layer}, which is none of its links {links}")
