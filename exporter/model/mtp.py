"""DeepSeek V4's MTP draft stage: one window-only block, chained a token at a time.

Its window row at position p comes from the target's streams at p - 1 and the token at
p, so the target passes compute those rows for their own positions (prefill writes them,
verify stages them for commit), and a slot keeps the streams of its last committed
position for the next pass. Position 0 has no predecessor: its row is never visible.
"""

from __future__ import annotations

import torch

from b12x_toolchain.exporter.model import buffer_names as names
from b12x_toolchain.exporter.model.blocks import hc_mix, rms_norm, rope
from b12x_toolchain.exporter.model.buffers import cache, staged_rows
from b12x_toolchain.exporter.model.cache_io import STATE_FORMAT
from b12x_toolchain.exporter.model.draft_stages import DraftStages
from b12x_toolchain.runtime.ops.opset import ops


def hidden_width(d) -> int:
    return d.hc_mult * d.hidden


class MtpDrafter(DraftStages):
    """Adds per stage the streams of the slot's last committed position (one row per slot)."""

    def stage_cache_specs(self, stage):
        return [cache(names.stage_cache("draft_hidden", stage), "draft_hidden", 1, STATE_FORMAT, hidden_width(self.d),
                      stage=stage)]

    def stage_staging_specs(self, stage):
        return [staged_rows(names.stage_staging("verify", "draft_hidden_staging", stage), "draft_hidden_staging",
                            self.d.verify_width, STATE_FORMAT, hidden_width(self.d), stage=stage)]

    def commit_stage(self, stage, caches, staging, row_ids, pos, accepted, end):
        ops.write_rows(caches[names.stage_cache("draft_hidden", stage)],
                       staging[names.stage_staging("verify", "draft_hidden_staging", stage)], row_ids,
                       torch.zeros_like(pos), accepted & (pos == end - 1), "bytes")

    # -- target passes ---------------------------------------------------------------------

    def mtp_input(self, w, p, tokens, prev_streams):
        d = self.d
        e = rms_norm(self.c.embed(w, tokens), w[p + "enorm.weight"], d.eps)
        h = rms_norm(prev_streams, w[p + "hnorm.weight"], d.eps)
        linear = self.c.linear
        return linear(w, p + "e_proj.weight", e)[:, :, None, :] + linear(w, p + "h_proj.weight", h)

    def stored_streams(self, caches, row_ids, stage):
        d = self.d
        zero = torch.zeros(row_ids.shape[0], 1, dtype=torch.long, device=row_ids.device)
        flat = ops.gather_rows(caches[names.stage_cache("draft_hidden", stage)], row_ids, zero, hidden_width(d),
                               STATE_FORMAT)
        return flat.view(-1, 1, d.hc_mult, d.hidden)

    def context(self, w, io, caches, row_ids, tokens, pos, streams, taps):
        """Window rows for this pass's positions (the layer's kv only) and the streams commit keeps."""
        d = self.d
        main = self.c.angles(pos)
        for s in range(d.draft_stages):
            p = f"mtp.{s}."
            prev = torch.cat([self.stored_streams(caches, row_ids, s), streams[:, :-1]], dim=1)
            _, _, collapsed = hc_mix(w, p + "attn_hc.", self.mtp_input(w, p, tokens, prev), d.hc_iters, d.hc_eps, d.eps)
            x = rms_norm(collapsed, w[p + "input_layernorm.weight"], d.eps)
            a = p + "self_attn."
            kv = rope(rms_norm(self.c.linear(w, a + "kv_proj.weight", x), w[a + "kv_norm.weight"], d.eps), main)
            owner = names.stage(s)
            io.rows(names.local("draft_context_staging", owner), names.window(owner), kv, d.window_format,
                    last_only=False)
            io.rows(names.local("draft_hidden_staging", owner), names.local("draft_hidden", owner), streams.flatten(-2),
                    STATE_FORMAT, last_only=True)

    # -- the draft pass -------------------------------------------------------------------------

    def draft(self, w, caches, staging, inputs):
        """`draft_width` single-token steps from the anchor, each feeding its argmax on."""
        d, c = self.d, self.c
        row_ids, positions, tokens = names.row_inputs(inputs, "slot_ids", "positions", "token_ids")
        stage = staging[names.stage_staging("draft", "draft_window_staging", 0)]
        ops.window_snapshot(caches[names.stage_cache("draft_window", 0)], stage, row_ids, positions, d.history, d.layout,
                            d.page_size)
        keys = [ops.window_read(stage, d.history, d.head_dim, d.window_format)]
        key_pos = positions.long()[:, None] + torch.arange(-d.history, 0, device=positions.device)
        token, prev, logits = tokens[:, :1], self.stored_streams(caches, row_ids, 0), []
        for j in range(d.draft_width):
            pos = positions.long()[:, None] + j

            def window_keys(kv):
                keys.append(ops.round_trip(kv, d.window_format))
                return torch.cat(keys, dim=1)

            main = c.angles(pos)
            key_pos = torch.cat([key_pos, pos], dim=1)
            prev = c.layer(w, "mtp.0.", self.mtp_input(w, "mtp.0.", token, prev), token, pos, main, window_keys,
                           c.visible(pos, key_pos, min_pos=1), d.moe)
            step, _ = c.logits(w, "mtp.0.", prev)
            logits.append(step)
            token = step.argmax(dim=-1)
        return {names.output("logits"): torch.cat(logits, dim=1)}
