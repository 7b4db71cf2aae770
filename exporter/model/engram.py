"""Engram, DeepSeek V4.1's n-gram memory, before the layers the recipe lists.

Per token, its compressed id and those of up to `max_ngram - 1` predecessors form 2- to
`max_ngram`-grams; each order's `heads` hashes pick one row of the layer's table each
(`engram_hash`, exact int64 arithmetic). The rows (`engram_lookup`: FP8 with a UE8M0 scale
per 32 values, decoded to bf16 as DeepSeek's reference does, or fp32 / bf16 as stored) are
projected by `wkv` to one key per hyper-connection stream and one shared value; each stream
gets the value times its own gate,

    g = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))),
    dot = sum_d h_d * q_d * k_d * key_d * rsqrt(mean(h^2) + eps) * rsqrt(mean(key^2) + eps) / sqrt(D),

in float32, with the RMSNorm gains q and k only as their product (`q_weight`, `k_weight`).
There is no short convolution (the V4.1 release omits it).

The history a hash needs is the compressed ids of the `max_ngram - 1` tokens before a pass's
first token: a per-slot ring (`token_history`, row = position % max_ngram) written like a
compressor's state ring — directly by prefill and decode, staged by verify and made
persistent by commit for the accepted rows only — so rollback, slot reuse (positions
restart; rows before position 0 count as before the sequence start) and prefix snapshots
(a ring, stored and restored as every ring is) need nothing of their own. Inside a pass, a
row's tokens are each other's predecessors: a verify block hashes as decoding it would.

Under tensor parallelism a layer's table is split by hash head, as vLLM splits it: with t
ranks, rank r holds the complete columns [r*k, min((r+1)*k, columns)), k = ceil(columns / t),
whose rows are one contiguous range of the table (`row_ranges`), padded with zero rows to
the longest range so every rank's shard has one shape. Each rank looks up its own columns
with row ids local to its range; an all-gather over the ranks puts the columns back in
order (padding columns dropped). On one device the lookup is the table's, as it was.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from b12x_toolchain.exporter.model import buffer_names
from b12x_toolchain.exporter.model.cache_io import _before
from b12x_toolchain.exporter.model.engram_hashing import layer_multipliers, layer_primes
from b12x_toolchain.runtime.ops import fixed_order
from b12x_toolchain.runtime.ops.engram_ops import prime_offsets
from b12x_toolchain.runtime.ops.opset import ops

TOKEN_MAP = "model.engram.token_map"  # int64 [vocab]: token id -> compressed id
HISTORY = buffer_names.ENGRAM_HISTORY  # the local name of the token-history ring and its staging
GATE_FLOOR = 1e-6  # |dot| below this takes sqrt(1e-6): the reference's clamp


def prefix(layer: int) -> str:
    return f"model.layers.{layer}.engram."


def table_rows(d) -> dict[int, int]:
    """Rows of each Engram layer's table: the sum of its heads' primes."""
    return {layer: sum(primes) for layer, primes in hash_primes(d).items()}


def hash_primes(d) -> dict[int, list[int]]:
    return _primes(d.engram)


@lru_cache(maxsize=8)
def _primes(e) -> dict[int, list[int]]:
    return layer_primes(e.prime_start, list(e.layer_ids), e.max_ngram - 1, e.heads)


def column_ranges(columns: int, parts: int) -> list[tuple[int, int]]:
    """Each of `parts` ranks' columns [first, stop): ceil(columns / parts) a rank, the last ones
    fewer (or none)."""
    k = -(-columns // parts)
    return [(min(r * k, columns), min((r + 1) * k, columns)) for r in range(parts)]


def row_ranges(d, layer: int, parts: int) -> list[tuple[int, int]]:
    """Each rank's rows [start, stop) of layer `layer`'s table: the rows of its columns."""
    primes = hash_primes(d)[layer]
    offsets = prime_offsets(primes) + [sum(primes)]  # each column's first row, then the table's end
    return [(offsets[first], offsets[stop]) for first, stop in column_ranges(len(primes), parts)]


class Engram:
    """The Engram layers of one model (Dims): hashes once per pass, then each layer's block."""

    def __init__(self, d, linear, mesh=None):
        self.d, self.e, self.linear, self.mesh = d, d.engram, linear, mesh
        self.primes = hash_primes(d)
        self.multipliers = {layer: layer_multipliers(layer, self.e.max_ngram, self.e.compressed_vocab)
                            for layer in self.e.layer_ids}

    def hashes(self, w, io, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
        """Table row ids [R, T, columns] of every Engram layer for this pass's tokens."""
        ids = w[TOKEN_MAP][tokens.long()]
        lookback = self.lookback(io, ids)
        return {layer: ops.engram_hash(ids, lookback, self.multipliers[layer], self.primes[layer], self.e.pad_id)
                for layer in self.e.layer_ids}

    def lookback(self, io, ids: torch.Tensor) -> torch.Tensor:
        """The compressed ids of the max_ngram - 1 committed tokens before each row's first
        token, oldest first; -1 (before the sequence start) where the position is negative.
        Records this pass's ids in the history ring (prefill, decode) or its staging (verify)."""
        n = self.e.max_ngram
        previous = io.state(HISTORY, n, ids.to(torch.float32)[..., None])[..., 0]
        return torch.where(_before(io.positions, n - 1) >= 0, previous.long(), -1)

    def block(self, w, layer: int, streams: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """Streams [R, T, N, D] plus each stream's gated value."""
        d, p = self.d, prefix(layer)
        rows = self.lookup(layer, w[p + "embed.weight"], w.get(p + "embed.weight_scale"), row_ids)
        kv = self.linear(w, p + "wkv.weight", rows.to(torch.float32))
        n, dim = streams.shape[-2:]
        key, value = kv[..., : n * dim].unflatten(-1, (n, dim)), kv[..., n * dim :]
        gain = self.linear.value(w, p + "q_weight") * self.linear.value(w, p + "k_weight")
        dot = (streams * gain * key).sum(-1)
        dot = dot * torch.rsqrt(streams.square().mean(-1) + d.eps) * torch.rsqrt(key.square().mean(-1) + d.eps)
        dot = dot / math.sqrt(dim)
        gate = fixed_order.sigmoid(torch.sign(dot) * dot.abs().clamp(min=GATE_FLOOR).sqrt())
        return streams + gate[..., None] * value[..., None, :]

    def lookup(self, layer: int, table, scale, row_ids: torch.Tensor) -> torch.Tensor:
        """The rows [R, T, columns * head_dim] that `row_ids` (global) name. Split by hash head,
        this rank reads its columns' rows from its shard and the all-gather assembles the rest."""
        mesh = self.mesh
        if mesh is None or mesh.tensor == 1:
            return ops.engram_lookup(table, scale, row_ids)
        columns = self.e.columns
        first, stop = column_ranges(columns, mesh.tensor)[mesh.rank]
        start = row_ranges(self.d, layer, mesh.tensor)[mesh.rank][0]
        per_rank = -(-columns // mesh.tensor)
        # A rank short of columns looks up row 0 of its shard (a real or a padding row) for the
        # missing ones; the gather's padding columns are dropped.
        local = row_ids[..., first:stop] - start
        if stop - first < per_rank:
            local = F.pad(local, (0, per_rank - (stop - first)))
        gathered = mesh.gather_last(ops.engram_lookup(table, scale, local))
        return gathered if columns % mesh.tensor == 0 else gathered[..., : columns * self.e.head_dim]
