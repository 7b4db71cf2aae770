"""The DeepSeek V4 / V4.1 decoder layer over b12x cache ops.

Layer compute follows `transformers`' DeepseekV4ForCausalLM. Where rows live is b12x's:
the window and compressor state are rings addressed by absolute position, compressed
entries are written as their group closes, and verify writes staging that commit makes
persistent. Compressed layers differ by kind (V4: CSA, HCA; V4.1: ratio-2 pool, ratio-1
direct) and, in V4.1, by CSA2 role: a Full layer compresses and indexes, a Reindex layer
ranks its source's keys with its own queries, a Reuse layer takes both unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from b12x_toolchain.exporter.model.blocks import (attend_with_sink, grouped_out, hc_head, hc_merge, hc_mix, inv_freq, mask_unseen, moe,
                                  pool, rms_norm, rope, rope_angles, top_k_mask, unit_rms_norm)
from b12x_toolchain.exporter.model.cache_io import _before
from b12x_toolchain.runtime.ops.opset import ops


class Shared:
    """What compressed layers hand on within one pass: entries by kv source, choices by index source."""

    def __init__(self):
        self.keys, self.index_keys, self.visible, self.candidates, self.chosen = {}, {}, {}, {}, {}


class DeepSeekCompute(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d

    # -- positions ----------------------------------------------------------------------

    def angles(self, pos):
        """(cos, sin) of the main RoPE (window-only layers) and of the compress RoPE (YaRN)."""
        d = self.d
        main = rope_angles(pos, inv_freq(d.rope_theta, d.rope_dim, None, pos.device))
        return main, rope_angles(pos, self.compress_freqs(pos.device))

    def compress_freqs(self, device):
        return inv_freq(self.d.compress_rope_theta, self.d.rope_dim, self.d.yarn, device)

    # -- one layer -------------------------------------------------------------------------

    def layer(self, w, p, streams, tokens, pos, angles, window_keys, moe_dims, *, min_pos=0, block_from=None,
              compressed=None):
        """Attention then MoE on the streams [R,T,N,D], each through mHC.

        window_keys(kv) -> (keys, key positions); keys from index `block_from` on are a
        non-causal block (DSpark), visible to every row of it.
        """
        d = self.d
        R, T = pos.shape
        post, comb, collapsed = hc_mix(w, p + "attn_hc.", streams, d.hc_iters, d.hc_eps, d.eps)
        x = rms_norm(collapsed, w[p + "input_layernorm.weight"], d.eps)
        a = p + "self_attn."
        cos, sin = angles
        q_res = rms_norm(F.linear(x, w[a + "q_a_proj.weight"]), w[a + "q_a_norm.weight"], d.eps)
        q = F.linear(q_res, w[a + "q_b_proj.weight"]).view(R, T, d.heads, d.head_dim)
        if d.v4:  # V4 normalises each query head; V4.1 does not
            q = unit_rms_norm(q, d.eps)
        q = rope(q, cos[:, :, None], sin[:, :, None])
        kv = rope(rms_norm(F.linear(x, w[a + "kv_proj.weight"]), w[a + "kv_norm.weight"], d.eps), cos, sin)
        keys, key_pos = window_keys(kv)
        kp, qp = key_pos[:, None, :], pos[:, :, None]
        ordered = kp <= qp
        if block_from is not None:
            ordered = ordered | (torch.arange(keys.shape[1], device=pos.device) >= block_from)[None, None, :]
        visible = (kp > qp - d.window) & (kp >= min_pos) & ordered
        if compressed is not None:
            extra_keys, extra_visible = compressed(x, q_res)
            keys, visible = torch.cat([keys, extra_keys], 1), torch.cat([visible, extra_visible], 2)
        out = attend_with_sink(q, mask_unseen(keys, visible), visible, w[a + "sinks"])
        out = rope(out, cos[:, :, None], -sin[:, :, None])  # K = V carried RoPE into the output
        streams = hc_merge(post, comb, grouped_out(w, a, out.flatten(2), d.o_groups), streams)
        post, comb, collapsed = hc_mix(w, p + "ffn_hc.", streams, d.hc_iters, d.hc_eps, d.eps)
        y = moe(w, p + "mlp.", rms_norm(collapsed, w[p + "post_attention_layernorm.weight"], d.eps), tokens, moe_dims)
        return hc_merge(post, comb, y, streams)

    def logits(self, w, p, streams):
        d = self.d
        h = rms_norm(hc_head(w, p, streams, d.hc_eps, d.eps), w[p + "norm.weight"], d.eps)
        return F.linear(h, w["lm_head.weight"]), h

    # -- compressed entries -----------------------------------------------------------------

    def stored_entries(self, caches, name, ratio, dim, fmt, row_ids):
        count = self.d.max_seq_len // ratio
        index = torch.arange(count, device=row_ids.device).expand(row_ids.shape[0], count)
        return ops.gather_rows(caches[f"cache.{name}"], row_ids, index, dim, fmt)

    def pooled(self, w, c, name, ratio, dim, kind, x, pos, io):
        """The normalised latent of the group closing at each position (before RoPE)."""
        d = self.d
        if kind == "direct":
            return rms_norm(F.linear(x, w[c + "kv_proj.weight"]), w[c + "kv_norm.weight"], d.eps)
        overlap = kind == "csa"
        width = 2 * dim if overlap else dim
        rows = torch.cat([F.linear(x, w[c + "kv_proj.weight"]), F.linear(x, w[c + "gate_proj.weight"])], dim=-1)
        span = 2 * ratio if overlap else ratio
        prev = io.state(name, span, rows)
        positions = torch.cat([_before(io.positions, span - 1), pos], dim=1)
        bias = w.get(c + "position_bias")
        if bias is None:
            bias = torch.zeros(ratio, width, device=x.device)
        pooled = pool(torch.cat([prev, rows], dim=1), positions, ratio, width, bias, overlap)
        return rms_norm(pooled, w[c + "kv_norm.weight"], d.eps)

    def entries(self, io, caches, row_ids, name, entries, ratio, dim, fmt):
        """Write (prefill) or stage (verify) this pass's entries; all entries, stored then new."""
        new = io.entries(name, entries, ratio, fmt)
        return torch.cat([self.stored_entries(caches, name, ratio, dim, fmt, row_ids), new], dim=1)

    def entry_visibility(self, pos, ratio, count):
        """Stored entries closed before the pass; this pass's once their group closed at or before t."""
        R, T = pos.shape
        stored = torch.arange(count, device=pos.device)[None, :] < (pos[:, :1] // ratio)
        closes = (pos + 1) % ratio == 0
        causal = torch.ones(T, T, dtype=torch.bool, device=pos.device).tril()
        return torch.cat([stored[:, None, :].expand(R, T, count), closes[:, None, :] & causal[None]], dim=2)

    def compressed_keys(self, w, i, io, caches, row_ids, pos, shared, compress):
        """attach(x, q_res) -> (keys, visible) for layer i's compressed entries, by kind and role."""
        d = self.d
        ratio, kind, role = d.ratios[i], d.kind(i), d.role(i)
        c = f"model.layers.{i}.self_attn.compressor."
        source = i if d.v4 else d.kv_source[i]
        start = rope_angles(pos - (ratio - 1), self.compress_freqs(pos.device))  # an entry sits at its group start

        def attach(x, q_res):
            if role == "full":
                latent = self.pooled(w, c, f"layer{i}.state", ratio, d.head_dim, kind, x, pos, io)
                shared.keys[i] = self.entries(io, caches, row_ids, f"layer{i}.compressed", rope(latent, *start), ratio,
                                              d.head_dim, d.compressed_format)
                shared.visible[i] = self.entry_visibility(pos, ratio, d.max_seq_len // ratio)
                if kind == "csa":  # V4: the indexer pools its own keys
                    pooled = self.pooled(w, c + "indexer.", f"layer{i}.index_state", ratio, d.index_head_dim, kind, x,
                                         pos, io)
                    index_keys = rope(pooled, *start)
                elif not d.v4:  # V4.1: index keys are a projection of the entry's latent
                    ic = c + "indexer."
                    index_keys = rope(rms_norm(F.linear(latent, w[ic + "k_proj.weight"]), w[ic + "k_norm.weight"], d.eps),
                                      *start)
                else:
                    index_keys = None
                if index_keys is not None:
                    shared.index_keys[i] = self.entries(io, caches, row_ids, f"layer{i}.index", index_keys, ratio,
                                                        d.index_head_dim, d.index_format)
            keys, visible = shared.keys[source], shared.visible[source]
            if (d.v4 and kind == "csa") or (not d.v4 and role in ("full", "reindex")):
                shared.chosen[i] = self.indexer(w, c + "indexer.", i, source, x, q_res, pos, visible, shared, compress,
                                                ratio)
            chooser = i if d.v4 else d.index_source[i]
            if chooser in shared.chosen:
                visible = visible & shared.chosen[chooser]
            return keys, visible
        return attach

    def indexer(self, w, c, layer, source, x, q_res, pos, visible, shared, compress, ratio):
        """The lightning indexer's choice: the top-k visible entries by its score."""
        d = self.d
        R, T = pos.shape
        cos, sin = compress
        q = F.linear(q_res, w[c + "q_b_proj.weight"]).view(R, T, d.index_heads, d.index_head_dim)
        q = rope(q, cos[:, :, None], sin[:, :, None])
        scores = torch.relu(torch.einsum("rthd,rsd->rths", q, shared.index_keys[source])) * d.index_head_dim ** -0.5
        head_weights = F.linear(x, w[c + "scorer.weights_proj.weight"]) * d.index_heads ** -0.5
        score = (scores * head_weights[..., None]).sum(dim=2).masked_fill(~visible, float("-inf"))
        if source in shared.candidates and layer > d.candidate_source:
            score = score.masked_fill(~shared.candidates[source], float("-inf"))
        if layer == d.candidate_source:
            shared.candidates[source] = self.candidate_blocks(score, pos, ratio)
        return top_k_mask(score, d.index_topk)

    def candidate_blocks(self, score, pos, ratio):
        """Entries in the top blocks of `candidate_block_size` entries by their best score,
        always with the block of the newest visible entry (hierarchical candidates)."""
        d = self.d
        R, T, S = score.shape
        count, size = d.max_seq_len // ratio, d.candidate_block_size
        entry = torch.cat([torch.arange(count, device=pos.device).expand(R, count), pos // ratio], dim=1)
        blocks = -(-count // size)
        # Rows past max_seq_len (prefill padding) name blocks that do not exist; no valid
        # query sees their entries, so any in-range block will do.
        block = (entry // size).clamp(max=blocks - 1)[:, None, :].expand(R, T, S)
        best = torch.full((R, T, blocks), float("-inf"), device=pos.device).scatter_reduce(
            -1, block, score, "amax")
        keep = top_k_mask(best, d.candidate_blocks)
        newest = (((pos + 1) // ratio - 1).clamp(min=0) // size).clamp(max=blocks - 1)
        keep = keep.scatter(-1, newest[..., None], torch.ones_like(newest[..., None], dtype=torch.bool))
        return keep.gather(-1, block)
