"""DeepSeek V4's four passes: the reference model's compute over b12x cache ops.

Layer compute follows `transformers`' DeepseekV4ForCausalLM; what differs is only where
rows live: the window and compressor state are rings addressed by absolute position,
compressed entries are written as their group closes, and verify writes staging that
commit makes persistent. The MTP stage drafts one token at a time: its row at position p
is computed from the target's streams at p - 1 and the token at p.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from b12x.exporter import v4_buffers as buffers
from b12x.exporter.cache_io import _before
from b12x.exporter.model import mask_unseen
from b12x.exporter.v4_blocks import (attend_with_sink, grouped_out, hc_head, hc_merge, hc_mix, inv_freq, moe, pool,
                                     rms_norm, rope, rope_angles, unit_rms_norm)
from b12x.exporter.v4_cache_io import STATE_FORMAT, V4DirectIO, V4StagedIO
from b12x.runtime.abi import BufferSpec

ops = torch.ops.b12x


class V4Pass(torch.nn.Module):
    name = ""

    def __init__(self, d):
        super().__init__()
        self.d, self.v = d, d.v4

    # -- positions and layers --------------------------------------------------------

    def angles(self, pos):
        """(cos, sin) of the main RoPE (window-only layers) and the compress RoPE (YaRN)."""
        d = self.d
        main = rope_angles(pos, inv_freq(d.rope_theta, d.rope_dim, None, pos.device))
        compress = rope_angles(pos, inv_freq(d.compress_rope_theta, d.rope_dim, self.v.yarn, pos.device))
        return main, compress

    def layer(self, w, p, streams, tokens, pos, angles, window_keys, min_pos, compressed=None):
        """One decoder layer on the streams [R,T,N,D]: attention then MoE, each through mHC."""
        d, v = self.d, self.v
        R, T = pos.shape
        post, comb, collapsed = hc_mix(w, p + "attn_hc.", streams, v.hc_iters, v.hc_eps, d.eps)
        x = rms_norm(collapsed, w[p + "input_layernorm.weight"], d.eps)
        a = p + "self_attn."
        cos, sin = angles
        q_res = rms_norm(F.linear(x, w[a + "q_a_proj.weight"]), w[a + "q_a_norm.weight"], d.eps)
        q = unit_rms_norm(F.linear(q_res, w[a + "q_b_proj.weight"]).view(R, T, d.heads, d.head_dim), d.eps)
        q = rope(q, cos[:, :, None], sin[:, :, None])
        kv = rope(rms_norm(F.linear(x, w[a + "kv_proj.weight"]), w[a + "kv_norm.weight"], d.eps), cos, sin)
        keys, key_pos = window_keys(kv)
        visible = ((key_pos[:, None, :] > pos[:, :, None] - d.window) & (key_pos[:, None, :] >= min_pos)
                   & (key_pos[:, None, :] <= pos[:, :, None]))
        if compressed is not None:
            extra_keys, extra_visible = compressed(x, q_res)
            keys, visible = torch.cat([keys, extra_keys], 1), torch.cat([visible, extra_visible], 2)
        out = attend_with_sink(q, mask_unseen(keys, visible), visible, w[a + "sinks"])
        out = rope(out, cos[:, :, None], -sin[:, :, None])  # K = V carried RoPE into the output
        streams = hc_merge(post, comb, grouped_out(w, a, out.flatten(2), v.o_groups), streams)
        post, comb, collapsed = hc_mix(w, p + "ffn_hc.", streams, v.hc_iters, v.hc_eps, d.eps)
        y = moe(w, p + "mlp.", rms_norm(collapsed, w[p + "post_attention_layernorm.weight"], d.eps), tokens, v)
        return hc_merge(post, comb, y, streams)

    def logits(self, w, p, streams):
        d = self.d
        h = hc_head(w, p, streams, self.v.hc_eps, d.eps)
        return F.linear(rms_norm(h, w[p + "norm.weight"], d.eps), w["lm_head.weight"])

    # -- compressed layers ------------------------------------------------------------

    def compress(self, w, c, name, entry, ratio, dim, overlap, x, pos, fmt, io, caches, row_ids, freqs):
        """Entries of one compressor (main or indexer): stored ones, then this pass's."""
        d = self.d
        width = 2 * dim if overlap else dim
        rows = torch.cat([F.linear(x, w[c + "kv_proj.weight"]), F.linear(x, w[c + "gate_proj.weight"])], dim=-1)
        span = buffers.state_span("csa" if overlap else "hca", ratio)
        prev = io.state(f"{name}.{entry}_state" if entry != "compressed" else f"{name}.state", span, rows)
        positions = torch.cat([_before(io.positions, span - 1), pos], dim=1)
        pooled = pool(torch.cat([prev, rows], dim=1), positions, ratio, width, w[c + "position_bias"], overlap)
        start = rope_angles(pos - (ratio - 1), freqs)  # an entry sits at its group's start
        entries = rope(rms_norm(pooled, w[c + "kv_norm.weight"], d.eps), *start)
        new = io.entries(f"{name}.{entry}", entries, ratio, fmt)
        count = d.max_seq_len // ratio
        index = torch.arange(count, device=x.device).expand(row_ids.shape[0], count)
        stored = ops.gather_rows(caches[f"cache.{name}.{entry}"], row_ids, index, dim, fmt)
        return torch.cat([stored, new], dim=1)

    def compressed_keys(self, w, i, ratio, io, caches, row_ids, pos, tokens, compress_angles, cos_sin):
        d, v = self.d, self.v
        kind = v.kind(ratio)
        c = f"model.layers.{i}.self_attn.compressor."
        name = f"layer{i}"

        def attach(x, q_res):
            keys = self.compress(w, c, name, "compressed", ratio, d.head_dim, kind == "csa", x, pos,
                                 d.compressed_format, io, caches, row_ids, compress_angles)
            visible = self.entry_visibility(pos, ratio, keys.shape[1] - pos.shape[1])
            if kind == "csa":
                visible = visible & self.indexer(w, c + "indexer.", name, ratio, x, q_res, pos, visible, io, caches,
                                                 row_ids, compress_angles, cos_sin)
            return keys, visible
        return attach

    def entry_visibility(self, pos, ratio, count):
        """Stored entries closed before the pass; this pass's once their group closed at or before t."""
        R, T = pos.shape
        stored = torch.arange(count, device=pos.device)[None, :] < (pos[:, :1] // ratio)
        closes = (pos + 1) % ratio == 0
        causal = torch.ones(T, T, dtype=torch.bool, device=pos.device).tril()
        return torch.cat([stored[:, None, :].expand(R, T, count), closes[:, None, :] & causal[None]], dim=2)

    def indexer(self, w, c, name, ratio, x, q_res, pos, visible, io, caches, row_ids, compress_angles, cos_sin):
        """The lightning indexer's choice: the top-k visible entries by its score."""
        d, v = self.d, self.v
        R, T = pos.shape
        keys = self.compress(w, c, name, "index", ratio, v.index_head_dim, True, x, pos, v.index_format, io, caches,
                             row_ids, compress_angles)
        cos, sin = cos_sin
        q = F.linear(q_res, w[c + "q_b_proj.weight"]).view(R, T, v.index_heads, v.index_head_dim)
        q = rope(q, cos[:, :, None], sin[:, :, None])
        scores = torch.relu(torch.einsum("rthd,rsd->rths", q, keys)) * v.index_head_dim ** -0.5
        head_weights = F.linear(x, w[c + "scorer.weights_proj.weight"]) * v.index_heads ** -0.5
        score = (scores * head_weights[..., None]).sum(dim=2).masked_fill(~visible, float("-inf"))
        top = score.topk(min(v.index_topk, score.shape[-1]), dim=-1)
        return torch.zeros_like(visible).scatter(-1, top.indices, top.values > float("-inf"))

    # -- the target and the MTP stage ------------------------------------------------------

    def target(self, w, io, caches, tokens, pos, row_ids):
        """All target layers; returns the logits and the final streams (the MTP's input)."""
        d = self.d
        main, compress = self.angles(pos)
        compress_freqs = inv_freq(d.compress_rope_theta, d.rope_dim, self.v.yarn, pos.device)
        x = F.embedding(tokens.long(), w["model.embed_tokens.weight"])
        streams = x[:, :, None, :].expand(-1, -1, self.v.hc_mult, -1)
        for i, ratio in enumerate(d.ratios):
            compressed = None
            if ratio:
                compressed = self.compressed_keys(w, i, ratio, io, caches, row_ids, pos, tokens, compress_freqs,
                                                  compress)
            streams = self.layer(w, f"model.layers.{i}.", streams, tokens, pos, compress if ratio else main,
                                 lambda kv, i=i: self.window_keys(io, f"layer{i}", kv, pos), 0, compressed)
        return self.logits(w, "model.", streams), streams

    def window_keys(self, io, owner, kv, pos):
        history = self.d.history
        keys = io.window(owner, kv)
        key_pos = torch.cat([pos[:, :1] + torch.arange(-history, 0, device=pos.device), pos], dim=1)
        return keys, key_pos

    def mtp_input(self, w, p, tokens, prev_streams):
        d = self.d
        e = rms_norm(F.embedding(tokens.long(), w["model.embed_tokens.weight"]), w[p + "enorm.weight"], d.eps)
        h = rms_norm(prev_streams, w[p + "hnorm.weight"], d.eps)
        return F.linear(e, w[p + "e_proj.weight"])[:, :, None, :] + F.linear(h, w[p + "h_proj.weight"])

    def mtp_kv(self, w, p, streams, cos_sin):
        """The MTP layer's window row, without the rest of the layer."""
        d, v = self.d, self.v
        _, _, collapsed = hc_mix(w, p + "attn_hc.", streams, v.hc_iters, v.hc_eps, d.eps)
        x = rms_norm(collapsed, w[p + "input_layernorm.weight"], d.eps)
        a = p + "self_attn."
        return rope(rms_norm(F.linear(x, w[a + "kv_proj.weight"]), w[a + "kv_norm.weight"], d.eps), *cos_sin)

    def stored_streams(self, caches, row_ids, stage):
        d, v = self.d, self.v
        zero = torch.zeros(row_ids.shape[0], 1, dtype=torch.long, device=row_ids.device)
        flat = ops.gather_rows(caches[f"cache.draft{stage}.hidden"], row_ids, zero, buffers.hidden_width(d), STATE_FORMAT)
        return flat.view(-1, 1, v.hc_mult, d.hidden)

    def mtp_context(self, w, io, caches, row_ids, tokens, pos, streams):
        """MTP window rows for this pass's positions and the streams commit keeps."""
        main, _ = self.angles(pos)
        for s in range(self.d.draft_stages):
            prev = torch.cat([self.stored_streams(caches, row_ids, s), streams[:, :-1]], dim=1)
            kv = self.mtp_kv(w, f"mtp.{s}.", self.mtp_input(w, f"mtp.{s}.", tokens, prev), main)
            io.rows(f"draft{s}.context", f"draft{s}.window", kv, self.d.window_format, last_only=False)
            io.rows(f"draft{s}.hidden", f"draft{s}.hidden", streams.flatten(-2), STATE_FORMAT, last_only=True)

    def base_inputs(self):
        return [buffers.row_input("row_ids"), buffers.row_input("positions")]


class PrefillPass(V4Pass):
    name = "prefill"

    def convention(self):
        d = self.d
        inputs = (buffers.weight_specs(d) + buffers.cache_specs(d)
                  + [buffers.row_input("tokens", d.prefill_chunk)] + self.base_inputs() + [buffers.row_input("lengths")])
        return inputs, [_logits(d, d.prefill_chunk)]

    def forward(self, weights, caches, staging, inputs):
        row_ids, positions, lengths = inputs["row_ids"], inputs["positions"], inputs["lengths"]
        io = V4DirectIO(self.d, caches, row_ids, positions, lengths)
        logits, streams = self.target(weights, io, caches, inputs["tokens"], io.pos, row_ids)
        self.mtp_context(weights, io, caches, row_ids, inputs["tokens"], io.pos, streams)
        ops.set_seq_len(caches["cache.seq_len"], row_ids, positions + lengths)
        return {"logits": logits}


class VerifyPass(V4Pass):
    name = "verify"

    def convention(self):
        d = self.d
        inputs = (buffers.weight_specs(d) + buffers.cache_specs(d) + buffers.verify_staging_specs(d)
                  + [buffers.row_input("tokens", d.verify_width)] + self.base_inputs())
        return inputs, [_logits(d, d.verify_width)]

    def forward(self, weights, caches, staging, inputs):
        row_ids, positions = inputs["row_ids"], inputs["positions"]
        io = V4StagedIO(self.d, caches, staging, row_ids, positions, "verify")
        pos = _positions(positions, self.d.verify_width)
        logits, streams = self.target(weights, io, caches, inputs["tokens"], pos, row_ids)
        self.mtp_context(weights, io, caches, row_ids, inputs["tokens"], pos, streams)
        return {"logits": logits}


class DraftPass(V4Pass):
    """MTP drafting: `width` single-token steps from the anchor, each feeding its argmax on."""

    name = "draft"

    def convention(self):
        d = self.d
        caches = [s for s in buffers.cache_specs(d) if s.name.startswith("cache.draft")]
        inputs = (buffers.weight_specs(d) + caches + buffers.draft_staging_specs(d)
                  + [buffers.row_input("tokens", d.draft_width)] + self.base_inputs())
        return inputs, [_logits(d, d.draft_width)]

    def forward(self, weights, caches, staging, inputs):
        d, w = self.d, weights
        row_ids, positions = inputs["row_ids"], inputs["positions"]
        stage = staging["staging.draft.draft0.window"]
        ops.window_snapshot(caches["cache.draft0.window"], stage, row_ids, positions, d.history, d.layout, d.page_size)
        history = ops.window_read(stage, d.history, d.head_dim, d.window_format)
        key_pos = positions.long()[:, None] + torch.arange(-d.history, 0, device=positions.device)
        keys, token, prev = [history], inputs["tokens"][:, :1], self.stored_streams(caches, row_ids, 0)
        logits = []
        for j in range(d.draft_width):
            pos = positions.long()[:, None] + j

            def window_keys(kv, pos=pos):
                keys.append(ops.round_trip(kv, d.window_format))
                return torch.cat(keys, dim=1), torch.cat([key_pos, pos], dim=1)

            main, _ = self.angles(pos)
            prev = self.layer(w, "mtp.0.", self.mtp_input(w, "mtp.0.", token, prev), token, pos, main,
                              window_keys, 1)
            key_pos = torch.cat([key_pos, pos], dim=1)
            step = self.logits(w, "mtp.0.", prev)
            logits.append(step)
            token = step.argmax(dim=-1)
        return {"logits": torch.cat(logits, dim=1)}


class CommitPass(V4Pass):
    """Make the first accept_len verify rows of each row persistent, byte for byte."""

    name = "commit"

    def convention(self):
        d = self.d
        inputs = (buffers.cache_specs(d) + buffers.verify_staging_specs(d)
                  + self.base_inputs() + [buffers.row_input("accept_len")])
        return inputs, [BufferSpec("next_positions", "output", "int32", ("rows",))]

    def forward(self, weights, caches, staging, inputs):
        d = self.d
        row_ids, positions, accept_len = inputs["row_ids"], inputs["positions"], inputs["accept_len"]
        width = d.verify_width
        pos = _positions(positions, width)
        accepted = torch.arange(width, device=pos.device)[None, :] < accept_len.long()[:, None]
        end = (positions.long() + accept_len.long())[:, None]

        def commit(name, index, keep):
            ops.write_rows(caches[f"cache.{name}"], staging[f"staging.verify.{name}"], row_ids, index, keep, "bytes")

        for i, ratio in enumerate(d.ratios):
            ops.window_commit(caches[f"cache.layer{i}.window"], staging[f"staging.verify.layer{i}.window"],
                              row_ids, positions, accept_len, d.history, width)
            if not ratio:
                continue
            kind = self.v.kind(ratio)
            span = buffers.state_span(kind, ratio)
            closes = accepted & ((pos + 1) % ratio == 0)
            recent = accepted & (pos > end - span)
            for entry, state in (("compressed", "state"),) + ((("index", "index_state"),) if kind == "csa" else ()):
                commit(f"layer{i}.{entry}", pos // ratio, closes)
                commit(f"layer{i}.{state}", pos % span, recent)
        for s in range(d.draft_stages):
            ops.write_rows(caches[f"cache.draft{s}.window"], staging[f"staging.verify.draft{s}.context"], row_ids,
                           pos % d.history, accepted, "bytes")
            commit(f"draft{s}.hidden", torch.zeros_like(pos), accepted & (pos == end - 1))
        next_positions = (positions + accept_len).to(torch.int32)
        ops.set_seq_len(caches["cache.seq_len"], row_ids, next_positions)
        return {"next_positions": next_positions}


def _positions(positions, width):
    return positions.long()[:, None] + torch.arange(width, device=positions.device)


def _logits(d, width):
    return BufferSpec("logits", "output", "float32", ("rows", width, d.vocab))


PASSES = {cls.name: cls for cls in (PrefillPass, VerifyPass, DraftPass, CommitPass)}
