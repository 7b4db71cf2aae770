"""DeepSeek V4.1's DSpark draft stages.

The target passes project the hidden states of `target_layer_ids` (each layer's streams,
averaged) into `main_x`; each stage caches `RoPE(kv_norm(kv_proj(main_x)))` as window
context for committed positions. The draft pass runs the block [anchor, noise...] through
every stage, non-causal inside the block, then picks tokens left to right: each row's
logits get a low-rank Markov bias from the previous row's token, and a sigmoid head gives
each row's confidence (the runtime ends the block at the first row below the recipe's
threshold).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from b12x_toolchain.exporter.model import buffer_names as names
from b12x_toolchain.exporter.model.blocks import rms_norm, rope
from b12x_toolchain.exporter.model.cache_io import StagedIO
from b12x_toolchain.exporter.model.draft_stages import DraftStages
from b12x_toolchain.exporter.model.linears import as_float32
from b12x_toolchain.runtime.ops import fixed_order
from b12x_toolchain.runtime.package.abi import BufferSpec


class DSparkDrafter(DraftStages):
    def outputs(self):
        return [BufferSpec(names.output("confidence"), "output", "float32", ("rows", self.d.draft_width))]

    def context(self, w, io, caches, row_ids, tokens, pos, streams, taps):
        main = self.c.angles(pos)
        for s, kv in enumerate(self.context_keys(w, main, self.main_hidden(taps))):
            io.rows(names.local("draft_context_staging", names.stage(s)), names.window(names.stage(s)), kv,
                    self.d.window_format, last_only=False)

    def main_hidden(self, taps) -> torch.Tensor:
        """[R, T, len(target_layer_ids) * D]: each target layer's streams, averaged, side by side."""
        return torch.cat([taps[i].mean(dim=-2) for i in self.d.target_layer_ids], dim=-1)

    def context_keys(self, w, main, hidden):
        """Each stage's window rows [R, T, D], stage by stage (a generator: a pass stages each
        before computing the next), at target positions whose main RoPE is `main`, from their
        `main_hidden`."""
        d = self.d
        main_x = rms_norm(self.c.linear(w, "dspark.main_proj.weight", hidden), w["dspark.main_norm.weight"], d.eps)
        for s in range(d.draft_stages):
            p = f"mtp.{s}."
            x = rms_norm(main_x, w[p + "input_layernorm.weight"], d.eps)
            a = p + "self_attn."
            yield rope(rms_norm(self.c.linear(w, a + "kv_proj.weight", x), w[a + "kv_norm.weight"], d.eps), main)

    def draft(self, w, caches, staging, inputs):
        d = self.d
        row_ids, positions, tokens = names.row_inputs(inputs, "slot_ids", "positions", "token_ids")
        io = StagedIO(d, caches, staging, row_ids, positions, "draft", {})
        logits, confidence = self.block(w, io, positions, tokens)
        rows, prev = [], tokens[:, 0]
        for j in range(d.draft_width):
            bias = self.markov_bias(w, prev)
            rows.append(logits[:, j] + bias)
            prev = rows[-1].argmax(dim=-1)
        return {names.output("logits"): torch.stack(rows, dim=1), names.output("confidence"): confidence}

    def block(self, w, io, positions, tokens):
        """The stages over the block `tokens` [R, W] from `positions`, non-causal inside it:
        (logits [R, W, V] before the Markov bias, confidence [R, W])."""
        d, c = self.d, self.c
        pos = positions.long()[:, None] + torch.arange(d.draft_width, device=positions.device)
        main = c.angles(pos).with_views()
        x = c.embed(w, tokens)
        streams = x[:, :, None, :].expand(-1, -1, d.hc_mult, -1).contiguous()  # every layer's streams alike
        visible = c.visible(pos, io.key_positions(d.draft_width), block_from=d.history)
        for s in range(d.draft_stages):
            def attention(streams, s=s):
                return c.attention(w, f"mtp.{s}.", streams, pos, main, lambda kv: io.window(names.stage(s), kv), visible)
            streams = c.ffn(w, f"mtp.{s}.", c.run_stage(s, w, io, streams, attention), tokens, d.draft_moe)
        logits, h = c.logits(w, "dspark.", streams)
        confidence = fixed_order.sigmoid(c.linear(w, "dspark.confidence.weight", h, w["dspark.confidence.bias"]))[..., 0]
        return logits, confidence

    def markov_bias(self, w, prev: torch.Tensor) -> torch.Tensor:
        """The low-rank bias [R, V] a row's logits get from the token picked before it."""
        return self.c.linear(w, "dspark.markov.out.weight", as_float32(F.embedding(prev.long(), w["dspark.markov.embed"])))
