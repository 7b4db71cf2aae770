"""The four passes a server runs — prefill, verify, draft, commit — for DeepSeek V4 / V4.1.

Each module's forward takes four dicts — weights, caches, staging, inputs — in the order
its calling convention lists them, and returns a dict of outputs. The layer compute is
layers.py; the draft stages (V4: MTP, V4.1: DSpark) are a drafter object. What a server
needs to drive a pass — its width, the input that advances the committed length, the pass
whose staging it makes persistent — is declared here and recorded in the manifest.
"""

from __future__ import annotations

import torch

from b12x_toolchain.exporter.model import buffer_names as names
from b12x_toolchain.exporter.model import buffers
from b12x_toolchain.exporter.model.cache_io import DirectIO, StagedIO, slot_mapping
from b12x_toolchain.exporter.model.dspark import DSparkDrafter
from b12x_toolchain.exporter.model.engram import Engram
from b12x_toolchain.exporter.model.layers import DeepSeekCompute, Shared
from b12x_toolchain.exporter.model.mtp import MtpDrafter
from b12x_toolchain.runtime.ops.opset import ops
from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.package.kinds import KINDS, kinds_for


class DeepSeekPass(DeepSeekCompute):
    name = ""
    advances = None  # the row input whose counts move the committed length (None: staging only)
    reads_staging_of = None  # the pass whose staging this one makes persistent

    def __init__(self, d, rank: int = 0):
        super().__init__(d, rank)
        self.drafter = (MtpDrafter if d.v4 else DSparkDrafter)(d, self)
        self.engram = Engram(d, self.linear, self.mesh) if d.engram is not None else None

    def target(self, w, io, caches, tokens, pos, row_ids):
        """All target layers; returns the logits, the final streams and each layer's streams."""
        d = self.d
        main = self.angles(pos).with_views()
        compress = self.compress_angles(pos).with_views() if any(d.ratios) else None
        x = self.embed(w, tokens)
        streams = x[:, :, None, :].expand(-1, -1, d.hc_mult, -1).contiguous()  # every layer's streams alike
        shared, taps = Shared(), {}
        visible = self.visible(pos, io.key_positions(pos.shape[1]))
        engram = self.engram.hashes(w, io, tokens) if self.engram else {}  # every layer's rows, before layer 0
        for i, ratio in enumerate(d.ratios):
            if i in engram:  # on the streams the layer's first mHC mix reads
                streams = self.engram.block(w, i, streams, engram[i])
            compressed = self.compressed_keys(w, i, io, caches, row_ids, pos, shared, compress) if ratio else None

            def attention(streams, i=i, ratio=ratio, compressed=compressed):
                return self.attention(w, f"model.layers.{i}.", streams, pos, compress if ratio else main,
                                      lambda kv: io.window(names.layer(i), kv), visible, compressed)
            streams = self.run_layer(i, w, io, shared, streams, attention)
            streams = taps[i] = self.ffn(w, f"model.layers.{i}.", streams, tokens, d.moe)
        logits, _ = self.logits(w, "model.", streams)
        return logits, streams, taps

    def base_inputs(self, caches):
        """Slot ids, positions, and a block table per page pool of the paged caches the pass binds."""
        return [buffers.row_input("slot_ids"), buffers.row_input("positions")] \
            + buffers.block_tables(caches)

    def width(self) -> int:
        return self.d.verify_width

    def caches(self):
        return buffers.cache_specs(self.d, self.drafter)

    def weights(self):
        return buffers.weight_specs(self.d)


class PrefillPass(DeepSeekPass):
    """A chunk of prompt tokens for each row: writes persistent caches directly."""

    name = "prefill"
    advances = names.row_input("new_tokens")

    def width(self) -> int:
        return self.d.prefill_chunk

    def convention(self):
        width = self.width()
        inputs = (self.weights() + self.caches() + [buffers.row_input("token_ids", width)]
                  + self.base_inputs(self.caches()) + [buffers.row_input("new_tokens")])
        return inputs, [_logits(self.d, width)]

    def forward(self, weights, caches, staging, inputs):
        row_ids, positions, lengths, tokens = names.row_inputs(inputs, "slot_ids", "positions", "new_tokens",
                                                               "token_ids")
        io = DirectIO(self.d, caches, row_ids, positions, lengths, _block_tables(inputs), self.width())
        logits, streams, taps = self.target(weights, io, caches, tokens, io.pos, row_ids)
        self.drafter.context(weights, io, caches, row_ids, tokens, io.pos, streams, taps)
        ops.set_seq_len(caches[names.SEQ_LEN], row_ids, positions + lengths)
        return {names.output("logits"): logits}


class DecodePass(PrefillPass):
    """Prefill one token wide: decoding without a drafter writes its token's rows directly,
    instead of verifying a block of noise and committing one row of it."""

    name = "decode"

    def width(self) -> int:
        return 1


class VerifyPass(DeepSeekPass):
    """Target forward over [anchor, d1..d7]; writes only staging."""

    name = "verify"

    def convention(self):
        d = self.d
        inputs = (self.weights() + self.caches() + buffers.verify_staging_specs(d, self.drafter)
                  + [buffers.row_input("token_ids", d.verify_width)] + self.base_inputs(self.caches()))
        return inputs, [_logits(d, d.verify_width)]

    def forward(self, weights, caches, staging, inputs):
        row_ids, positions, tokens = names.row_inputs(inputs, "slot_ids", "positions", "token_ids")
        io = StagedIO(self.d, caches, staging, row_ids, positions, "verify", _block_tables(inputs))
        pos = _positions(positions, self.d.verify_width)
        logits, streams, taps = self.target(weights, io, caches, tokens, pos, row_ids)
        self.drafter.context(weights, io, caches, row_ids, tokens, pos, streams, taps)
        return {names.output("logits"): logits}


class DraftPass(DeepSeekPass):
    name = "draft"

    def width(self) -> int:
        return self.d.draft_width

    def convention(self):
        d = self.d
        inputs = (self.weights() + self.drafter.cache_specs() + self.drafter.draft_staging_specs()
                  + [buffers.row_input("token_ids", d.draft_width)] + self.base_inputs(self.drafter.cache_specs()))
        return inputs, [_logits(d, d.draft_width)] + self.drafter.outputs()

    def forward(self, weights, caches, staging, inputs):
        return self.drafter.draft(weights, caches, staging, inputs)


class CommitPass(DeepSeekPass):
    """Make the first accept_len verify rows of each row persistent, byte for byte."""

    name = "commit"
    advances = names.row_input("accepted_tokens")
    reads_staging_of = "verify"

    def convention(self):
        inputs = (self.caches() + buffers.verify_staging_specs(self.d, self.drafter)
                  + self.base_inputs(self.caches()) + [buffers.row_input("accepted_tokens")])
        return inputs, [BufferSpec(names.output("next_positions"), "output", "int32", ("rows",))]

    def forward(self, weights, caches, staging, inputs):
        d = self.d
        row_ids, positions, accept_len = names.row_inputs(inputs, "slot_ids", "positions", "accepted_tokens")
        width = d.verify_width
        pos = _positions(positions, width)
        accepted = torch.arange(width, device=pos.device)[None, :] < accept_len.long()[:, None]
        end = (positions.long() + accept_len.long())[:, None]
        tables = _block_tables(inputs)
        for i, ratio in enumerate(d.ratios):
            for c in buffers.owned_caches(d, i):
                cache, stage = caches[names.cache(c.name)], staging[names.staging(self.reads_staging_of, c.name)]
                if c.kind == "window_ring":
                    ops.window_commit(cache, stage, row_ids, positions, accept_len, d.history, width)
                elif c.kind in ("compressed_entries", "index_keys"):  # persistent once its group closes
                    slots = slot_mapping(tables[KINDS[c.kind].pool], pos // ratio, accepted & ((pos + 1) % ratio == 0),
                                         cache.shape[1] // c.row_bytes)
                    ops.write_slots(cache, stage, slots, "bytes")
                else:  # state: the last span - 1 committed rows are all a later group can read
                    _commit_ring(cache, stage, row_ids, pos, accepted, end, c.rows)
        history = buffers.token_history(d)
        if history is not None:  # Engram's token history is a state ring too
            _commit_ring(caches[names.cache(history.name)], staging[names.staging(self.reads_staging_of, history.name)],
                         row_ids, pos, accepted, end, history.rows)
        self.drafter.commit(caches, staging, row_ids, pos, accepted, end)
        next_positions = (positions + accept_len).to(torch.int32)
        ops.set_seq_len(caches[names.SEQ_LEN], row_ids, next_positions)
        return {names.output("next_positions"): next_positions}


def _commit_ring(cache, stage, row_ids, pos, accepted, end, rows: int) -> None:
    """Accepted staged rows into a ring of `rows` per slot: the last `rows` positions of a row's
    committed ones (a later pass can read the last rows - 1; the ring ends as decoding leaves it)."""
    ops.write_rows(cache, stage, row_ids, pos % rows, accepted & (pos >= end - rows), "bytes")


def _block_tables(inputs) -> dict:
    """The pass's block tables by page pool."""
    return {KINDS[kind].pool: inputs[names.row_input(kind)] for kind in kinds_for("input")
            if KINDS[kind].pool and names.row_input(kind) in inputs}


def _positions(positions, width):
    return positions.long()[:, None] + torch.arange(width, device=positions.device)


def _logits(d, width):
    return BufferSpec(names.output("logits"), "output", "float32", ("rows", width, d.vocab))


PASSES = {cls.name: cls for cls in (PrefillPass, DecodePass, VerifyPass, DraftPass, CommitPass)}
PassModule = DeepSeekPass
