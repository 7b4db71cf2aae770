"""Tensor and expert parallelism: which weights each rank holds, and the collectives between.

The shard plan follows vLLM's for DeepSeek V4 (latent projections replicated, the q
up-projection column-parallel by heads, the grouped O column-parallel by groups and then
row-parallel, the embedding and head vocab-parallel, shared experts column then row
parallel) and is data: a weight's split is looked up by the end of its name. Routed
experts are whole per rank under expert parallelism, else split by intermediate
dimension. Engram's tables are split by hash head: each rank holds its complete columns'
rows, one range of the table's rows (exporter/model/engram.py). Everything else — norms, mHC, the compressors, the indexer, the routers,
DSpark's projections — is replicated: MLA has one latent KV head, so every rank keeps
the same window and compressed caches (no data-parallel attention).

Collectives are torch's functional ones (`_c10d_functional.*` in an exported graph) over
the default group, with fixed shapes so a CUDA graph captures them: an all-reduce after
each row-parallel projection and after the experts, an all-gather of the head's logits.
On one device none is emitted and every graph is what it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from b12x_toolchain.exporter.model.engram import prefix, row_ranges
from b12x_toolchain.exporter.model.weight_roles import DOWN, GATE_UP
from b12x_toolchain.exporter.model.weights import SCALE_SUFFIX, Spec, weight_specs
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.parallel.mapping import Split

# The end of a weight's name -> the axis its tensor-parallel split cuts.
TENSOR_SPLITS = {
    "self_attn.q_b_proj.weight": 0,  # column-parallel: whole heads
    "self_attn.sinks": 0,  # one per head
    "self_attn.o_a_proj.weight": 0,  # column-parallel: whole O groups (a group reads whole heads)
    "self_attn.o_b_proj.weight": 1,  # row-parallel: the all-reduce follows
    "shared_experts.gate_proj.weight": 0,
    "shared_experts.up_proj.weight": 0,
    "shared_experts.down_proj.weight": 1,
    "model.embed_tokens.weight": 0,  # vocab-parallel
    "lm_head.weight": 0,
}
# Routed experts [E, 2I, D] and [E, D, I]: the expert axis under expert parallelism; else the
# intermediate one (gate_up holds gate then up, so each half is split).
EXPERT_SPLITS = {GATE_UP: 1, DOWN: 2}


def check_rank(d: Dims, rank: int) -> None:
    if not 0 <= rank < d.world_size:
        raise ValueError(f"rank {rank} is out of range; expected 0 <= rank < world size {d.world_size}")


def _holds(name: str, weight_suffix: str) -> bool:
    """Whether stored tensor `name` is a weight whose name ends in `weight_suffix`, or its scale."""
    return name.endswith((weight_suffix, weight_suffix + SCALE_SUFFIX))


def split_of(name: str, d: Dims) -> Split | None:
    """How `name` is split across d's ranks (None: every rank holds all of it). A block-scaled
    weight's scale is split as its data, along the same axis (the recipe keeps the cut on block
    boundaries: weight_layout.py)."""
    table = engram_table_layer(name, d)
    if table is not None:
        return Split(0, d.tensor, ranges=tuple(row_ranges(d, table, d.tensor))) if d.tensor > 1 else None
    for suffix, axis in TENSOR_SPLITS.items():
        if _holds(name, suffix):
            return Split(axis, d.tensor) if d.tensor > 1 else None
    for suffix, axis in EXPERT_SPLITS.items():
        if _holds(name, suffix):
            if d.expert > 1:
                return Split(0, d.expert)
            return Split(axis, d.tensor, suffix == GATE_UP) if d.tensor > 1 else None
    return None


def engram_table_layer(name: str, d: Dims) -> int | None:
    """The Engram layer whose table (data or scales) `name` is, else None."""
    if d.engram is None:
        return None
    for layer in d.engram.layer_ids:
        if name in (prefix(layer) + "embed.weight", prefix(layer) + "embed.weight" + SCALE_SUFFIX):
            return layer
    return None


def engram_tables(d: Dims) -> tuple[str, ...]:
    """The weights that are Engram tables, data and scales (the manifest's weights.engram_tables)."""
    return tuple(name for name in weight_specs(d) if engram_table_layer(name, d) is not None)


def rank_weight_specs(d: Dims) -> dict[str, Spec]:
    """Every weight one rank holds, with its local shape (all of the model on one device)."""
    specs = weight_specs(d)
    out = {}
    for name, (shape, dtype) in specs.items():
        split = split_of(name, d)
        out[name] = (split.shape(shape) if split else shape, dtype)
    return out


def rank_weights(weights: dict[str, torch.Tensor], d: Dims, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shards of a whole model's weights."""
    check_rank(d, rank)
    out = {}
    for name, tensor in weights.items():
        split = split_of(name, d)
        out[name] = split.take(tensor, rank) if split else tensor
    return out


def weight_bytes(d: Dims) -> dict:
    """Bytes per rank: of the split tensors (as each rank holds them: an Engram table's shard
    with its padding rows), of the replicated ones (listed), and the ideal split. Stored bytes,
    so they follow the weights' formats: a block-scaled weight is its data and its scales.

    `per_rank` is with every weight on the device; with the Engram tables in host memory
    (`engram_tables="host"`), `per_rank_device` is what stays on the device and
    `per_rank_host` is the tables' share of a rank, in the host's pinned memory."""
    split_bytes = sharded_per_rank = replicated_bytes = tables = 0
    replicated = []
    for name, (shape, dtype) in weight_specs(d).items():
        itemsize = getattr(torch, dtype).itemsize
        size = math.prod(shape) * itemsize
        split = split_of(name, d)
        local = math.prod(split.shape(shape)) * itemsize if split else size
        if split:
            split_bytes += size
            sharded_per_rank += local
        else:
            replicated_bytes += size
            replicated.append(name)
        if engram_table_layer(name, d) is not None:
            tables += local
    world = d.world_size
    per_rank = sharded_per_rank + replicated_bytes
    return {"world_size": world, "sharded_per_rank": sharded_per_rank, "sharded_ideal": split_bytes / world,
            "replicated": replicated_bytes, "replicated_names": replicated, "per_rank": per_rank,
            "per_rank_device": per_rank - tables, "per_rank_host": tables}


@dataclass(frozen=True)
class Mesh:
    """Where this rank sits, and the collectives its graphs hold (none on one device)."""

    tensor: int = 1
    expert: int = 1
    rank: int = 0

    @classmethod
    def of(cls, d: Dims, rank: int = 0) -> "Mesh":
        check_rank(d, rank)
        return cls(d.tensor, d.expert, rank)

    @property
    def world_size(self) -> int:
        return max(self.tensor, self.expert)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x."""
        if self.world_size == 1:
            return x
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed import group
        return funcol.all_reduce(x, "sum", group.WORLD)

    def tensor_sum(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel projection's partial x (x itself without tensor parallelism)."""
        return x if self.tensor == 1 else self.reduce(x)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last axis, in rank order."""
        if self.tensor == 1:
            return x
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed import group
        stacked = funcol.all_gather_single(x.contiguous(), 0, group.WORLD)  # [ranks * rows, ..., local]
        # [ranks, rows, ..., local] -> [rows, ..., ranks, local] -> [rows, ..., ranks * local]; a view,
        # not a chunk, so a dynamic rows dimension stays dynamic.
        return stacked.unflatten(0, (self.tensor, -1)).movedim(0, -2).flatten(-2)

    def embed(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The embedding of `tokens`, each rank holding a slice of the vocabulary: a token outside
        it contributes zeros, so the sum over ranks is the row itself, bit for bit."""
        if self.tensor == 1:
            return F.embedding(tokens.long(), table)
        rows = table.shape[0]
        local = tokens.long() - self.rank * rows
        inside = (local >= 0) & (local < rows)
        found = F.embedding(local.clamp(0, rows - 1), table)
        return self.tensor_sum(torch.where(inside[..., None], found, torch.zeros_like(found)))

    def experts(self, count: int) -> slice | None:
        """This rank's routed experts out of `count` (None: all)."""
        if self.expert == 1:
            return None
        per_rank = count // self.expert
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)
