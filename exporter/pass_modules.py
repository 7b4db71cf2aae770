"""The four passes a server runs, as torch modules whose cache accesses are `b12x` ops.

Each module's forward takes four dicts — weights, caches, staging, inputs — in the order
its calling convention lists them, and returns a dict of outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from b12x.exporter import buffers
from b12x.exporter.cache_io import DirectIO, StagedIO, open_group_rows
from b12x.exporter.dims import Dims
from b12x.exporter.model import attend, mask_unseen, pool_groups, rms_norm, rope, swiglu
from b12x.runtime.abi import BufferSpec

ops = torch.ops.b12x


class PassModule(torch.nn.Module):
    name = ""

    def __init__(self, d: Dims):
        super().__init__()
        self.d = d

    def convention(self) -> tuple[list[BufferSpec], list[BufferSpec]]:
        raise NotImplementedError

    # -- shared compute -------------------------------------------------------------

    def block(self, w, prefix, h, pos, window_keys, theta, extra=None, causal=True):
        """Attention over window keys (+ compressed keys) then the MLP, both residual."""
        d = self.d
        R, T, _ = h.shape
        x = rms_norm(h, w[prefix + "attn_norm"], d.eps)
        q = rope(F.linear(x, w[prefix + "wq"]).view(R, T, d.heads, d.head_dim), pos[..., None], theta, d.rope_dim)
        kv = rope(rms_norm(F.linear(x, w[prefix + "wkv"]), w[prefix + "kv_norm"], d.eps), pos, theta, d.rope_dim)
        keys, key_pos = window_keys(kv), self.window_positions(pos, T)
        visible = (key_pos[:, None, :] > pos[:, :, None] - d.window) & (key_pos[:, None, :] >= 0)
        block_keys = torch.arange(keys.shape[1], device=h.device) >= d.history
        if causal:
            visible = visible & (key_pos[:, None, :] <= pos[:, :, None])
        else:  # DSpark draft block: every block row sees the whole block
            visible = visible | block_keys[None, None, :]
        if extra is not None:
            extra_keys, extra_visible = extra(x)
            keys, visible = torch.cat([keys, extra_keys], 1), torch.cat([visible, extra_visible], 2)
        h = h + F.linear(attend(q, mask_unseen(keys, visible), visible), w[prefix + "wo"])
        return h + swiglu(w, prefix, rms_norm(h, w[prefix + "mlp_norm"], d.eps))

    def window_positions(self, pos, width):
        first = pos[:, :1]
        return torch.cat([first + torch.arange(-self.d.history, 0, device=pos.device), pos], dim=1)

    def compressed_keys(self, w, layer, ratio, io, caches, row_ids, pos, x):
        """Persistent compressed entries plus the entries this pass closes, with visibility."""
        d = self.d
        prefix = f"layers.{layer}."
        kv = F.linear(x, w[prefix + "wc"])
        if ratio > 1:
            rows = torch.cat([kv, F.linear(x, w[prefix + "wg"])], dim=-1)
            prev = io.open_group(layer, ratio, rows)
            kv = pool_groups(torch.cat([prev, rows], dim=1), ratio, d.head_dim)
        entries = rope(rms_norm(kv, w[prefix + "c_norm"], d.eps), pos - (ratio - 1), d.compress_rope_theta, d.rope_dim)
        new = io.compressed(layer, entries, ratio)
        count = d.compressed_entries(ratio)
        stored = ops.gather_rows(caches[f"cache.layer{layer}.compressed"], row_ids,
                                 torch.arange(count, device=x.device).expand(row_ids.shape[0], count),
                                 d.head_dim, d.compressed_format)
        T = pos.shape[1]
        stored_visible = torch.arange(count, device=x.device)[None, :] < (pos[:, :1] // ratio)
        closes = (pos + 1) % ratio == 0
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        new_visible = closes[:, None, :] & causal[None]
        visible = torch.cat([stored_visible[:, None, :].expand(-1, T, -1), new_visible], dim=2)
        return torch.cat([stored, new], dim=1), visible

    def target(self, w, io, caches, tokens, pos, row_ids):
        """The target layers; returns final hidden states and the hiddens the drafter reads."""
        d = self.d
        h = F.embedding(tokens.long(), w["embed"])
        taps = {}
        for i, ratio in enumerate(d.ratios):
            theta = d.compress_rope_theta if ratio else d.rope_theta
            extra = None
            if ratio:
                extra = (lambda x, i=i, ratio=ratio: self.compressed_keys(w, i, ratio, io, caches, row_ids, pos, x))
            h = self.block(w, f"layers.{i}.", h, pos, lambda kv, i=i: io.window(f"layer{i}", kv), theta, extra)
            if i in d.target_layer_ids:
                taps[i] = h
        main = torch.cat([taps[i] for i in d.target_layer_ids], dim=-1)
        main_x = rms_norm(F.linear(main, w["draft.main_proj"]), w["draft.main_norm"], d.eps)
        for s in range(d.draft_stages):
            prefix = f"draft.{s}."
            x = rms_norm(main_x, w[prefix + "attn_norm"], d.eps)
            ctx = rope(rms_norm(F.linear(x, w[prefix + "wkv"]), w[prefix + "kv_norm"], d.eps), pos, d.rope_theta, d.rope_dim)
            io.context(s, ctx)
        return F.linear(rms_norm(h, w["final_norm"], d.eps), w["lm_head"])

    def positions_of(self, positions, width):
        return positions.long()[:, None] + torch.arange(width, device=positions.device)

    def base_inputs(self):
        return [buffers.row_input("row_ids"), buffers.row_input("positions")]


class PrefillPass(PassModule):
    """A chunk of prompt tokens for each row: writes persistent caches directly."""

    name = "prefill"

    def convention(self):
        d = self.d
        inputs = (buffers.weight_specs(d) + buffers.cache_specs(d)
                  + [buffers.row_input("tokens", d.prefill_chunk)] + self.base_inputs() + [buffers.row_input("lengths")])
        return inputs, [buffers.logits_output(d, d.prefill_chunk)]

    def forward(self, weights, caches, staging, inputs):
        row_ids, positions, lengths = inputs["row_ids"], inputs["positions"], inputs["lengths"]
        io = DirectIO(self.d, caches, row_ids, positions, lengths)
        logits = self.target(weights, io, caches, inputs["tokens"], io.pos, row_ids)
        ops.set_seq_len(caches["cache.seq_len"], row_ids, positions + lengths)
        return {"logits": logits}


class VerifyPass(PassModule):
    """Target forward over [anchor, d1..d7]; writes only staging."""

    name = "verify"

    def convention(self):
        d = self.d
        inputs = (buffers.weight_specs(d) + buffers.cache_specs(d) + buffers.verify_staging_specs(d)
                  + [buffers.row_input("tokens", d.verify_width)] + self.base_inputs())
        return inputs, [buffers.logits_output(d, d.verify_width)]

    def forward(self, weights, caches, staging, inputs):
        row_ids, positions = inputs["row_ids"], inputs["positions"]
        io = StagedIO(self.d, caches, staging, row_ids, positions, "verify")
        pos = self.positions_of(positions, self.d.verify_width)
        return {"logits": self.target(weights, io, caches, inputs["tokens"], pos, row_ids)}


class DraftPass(PassModule):
    """DSpark-style block [anchor, noise x6]: window-only stages, non-causal in the block."""

    name = "draft"

    def convention(self):
        d = self.d
        draft_caches = [s for s in buffers.cache_specs(d) if s.name.startswith("cache.draft")]
        inputs = (buffers.weight_specs(d) + draft_caches + buffers.draft_staging_specs(d)
                  + [buffers.row_input("tokens", d.draft_width)] + self.base_inputs())
        return inputs, [buffers.logits_output(d, d.draft_width)]

    def forward(self, weights, caches, staging, inputs):
        d = self.d
        row_ids, positions = inputs["row_ids"], inputs["positions"]
        io = StagedIO(d, caches, staging, row_ids, positions, "draft")
        pos = self.positions_of(positions, d.draft_width)
        h = F.embedding(inputs["tokens"].long(), weights["embed"])
        for s in range(d.draft_stages):
            h = self.block(weights, f"draft.{s}.", h, pos, lambda kv, s=s: io.window(f"draft{s}", kv),
                           d.rope_theta, causal=False)
        return {"logits": F.linear(rms_norm(h, weights["draft.final_norm"], d.eps), weights["lm_head"])}


class CommitPass(PassModule):
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
        pos = self.positions_of(positions, width)
        accepted = torch.arange(width, device=pos.device)[None, :] < accept_len.long()[:, None]
        end = positions.long() + accept_len.long()
        for i, ratio in enumerate(d.ratios):
            ops.window_commit(caches[f"cache.layer{i}.window"], staging[f"staging.verify.layer{i}.window"],
                              row_ids, positions, accept_len, d.history, width)
            if ratio:
                closes = accepted & ((pos + 1) % ratio == 0)
                ops.write_rows(caches[f"cache.layer{i}.compressed"], staging[f"staging.verify.layer{i}.compressed"],
                               row_ids, pos // ratio, closes, "bytes")
            if ratio > 1:
                ops.write_rows(caches[f"cache.layer{i}.state"], staging[f"staging.verify.layer{i}.state"],
                               row_ids, pos % ratio, open_group_rows(pos, accepted, end, ratio), "bytes")
        for s in range(d.draft_stages):
            ops.write_rows(caches[f"cache.draft{s}.window"], staging[f"staging.verify.draft{s}.context"],
                           row_ids, pos % d.history, accepted, "bytes")
        next_positions = (positions + accept_len).to(torch.int32)
        ops.set_seq_len(caches["cache.seq_len"], row_ids, next_positions)
        return {"next_positions": next_positions}


V41_PASSES = {cls.name: cls for cls in (PrefillPass, VerifyPass, DraftPass, CommitPass)}


def _for_family(name):
    def make(d: Dims) -> torch.nn.Module:
        if d.family == "deepseek_v4":
            from b12x.exporter.v4_passes import PASSES as V4_PASSES

            return V4_PASSES[name](d)
        return V41_PASSES[name](d)
    return make


# Pass name -> factory taking Dims, in pass order; the recipe's family picks the model.
PASSES = {name: _for_family(name) for name in V41_PASSES}
