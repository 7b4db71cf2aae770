"""A package's parallel mapping, as the manifest records it: ranks, their files, and how each
weight is split.

    "parallel": {"tensor": 2, "expert": 2, "world_size": 2,
                 "ranks": [{"graphs": {"verify": "ranks/0/graphs/verify.pt2", ...},
                            "weights": "ranks/0/weights.safetensors"}, ...],
                 "splits": {"lm_head.weight": {"axis": 0, "parts": 2, "halves": false}, ...},
                 "collectives": {"verify": {"all_reduce": 16}, ...}}

A package exported for one device has no `parallel` entry. `splits` is what lets a
runtime cut a rank's shard out of a whole checkpoint without the exporter's shard plan:
the rule is data, applied by `Split.take`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from b12x_toolchain.runtime.errors import PackageError


@dataclass(frozen=True)
class Split:
    """A weight cut into `parts` equal pieces along `axis`; rank r holds piece r. With `halves`
    the axis holds two stacked halves (an expert's gate then up), each cut on its own."""

    axis: int
    parts: int
    halves: bool = False

    def take(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        pieces = tensor.chunk(2, dim=self.axis) if self.halves else (tensor,)
        return torch.cat([p.chunk(self.parts, dim=self.axis)[index] for p in pieces], dim=self.axis).contiguous()

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape[: self.axis] + (shape[self.axis] // self.parts,) + shape[self.axis + 1 :]

    def whole(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the tensor a piece of `shape` was cut from."""
        return shape[: self.axis] + (shape[self.axis] * self.parts,) + shape[self.axis + 1 :]

    def to_json(self) -> dict:
        return {"axis": self.axis, "parts": self.parts, "halves": self.halves}

    @classmethod
    def from_json(cls, name: str, data) -> "Split":
        if not isinstance(data, dict) or set(data) != {"axis", "parts", "halves"}:
            raise PackageError(f"manifest.json: parallel.splits.{name} is not {{axis, parts, halves}}")
        axis, parts, halves = data["axis"], data["parts"], data["halves"]
        if not (_count(axis) and _count(parts) and parts >= 1 and isinstance(halves, bool)):
            raise PackageError(f"manifest.json: parallel.splits.{name} = {data!r}; expected a non-negative axis, "
                               "a positive number of parts and a boolean")
        return cls(axis, parts, halves)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class RankEntry:
    """One rank's files: its graph per pass, and its weights (None in a structural package)."""

    graphs: dict[str, str]
    weights: str | None

    def to_json(self) -> dict:
        return {"graphs": dict(self.graphs), "weights": self.weights}


@dataclass(frozen=True)
class Mapping:
    tensor: int
    expert: int
    world_size: int
    ranks: tuple[RankEntry, ...]
    splits: dict[str, Split]
    collectives: dict[str, dict[str, int]] | None = None  # per pass: collective -> how many its graph issues

    def describe(self) -> str:
        return f"tensor {self.tensor}, expert {self.expert} (world size {self.world_size})"

    def to_json(self) -> dict:
        out = {"tensor": self.tensor, "expert": self.expert, "world_size": self.world_size,
               "ranks": [r.to_json() for r in self.ranks],
               "splits": {n: s.to_json() for n, s in sorted(self.splits.items())}}
        if self.collectives is not None:
            out["collectives"] = dict(self.collectives)
        return out

    @classmethod
    def from_json(cls, data, pass_names) -> "Mapping":
        """The checked `parallel` entry of a manifest whose passes are `pass_names`."""
        if not isinstance(data, dict):
            raise PackageError("manifest.json: parallel is not an object")
        tensor, expert, world = data.get("tensor"), data.get("expert"), data.get("world_size")
        if not all(_count(v) and v >= 1 for v in (tensor, expert, world)) or world != max(tensor, expert) \
                or {tensor, expert} - {1, world}:
            raise PackageError(f"manifest.json: parallel maps tensor {tensor!r}, expert {expert!r} onto world size "
                               f"{world!r}; expected each of tensor and expert to be 1 or the world size")
        ranks = data.get("ranks")
        if not isinstance(ranks, list) or len(ranks) != world:
            raise PackageError(f"manifest.json: parallel.ranks must list {world} ranks")
        for r, entry in enumerate(ranks):
            graphs = entry.get("graphs") if isinstance(entry, dict) else None
            if not isinstance(graphs, dict) or set(graphs) != set(pass_names) \
                    or not all(isinstance(f, str) for f in graphs.values()):
                raise PackageError(f"manifest.json: parallel.ranks[{r}].graphs must name a graph file for each pass "
                                   f"({', '.join(sorted(pass_names))})")
            if not (entry.get("weights") is None or isinstance(entry.get("weights"), str)):
                raise PackageError(f"manifest.json: parallel.ranks[{r}].weights is not a file name")
        splits = data.get("splits")
        if not isinstance(splits, dict):
            raise PackageError("manifest.json: parallel.splits is missing")
        collectives = data.get("collectives")
        if not (collectives is None or isinstance(collectives, dict) and all(
                isinstance(c, dict) and all(_count(n) for n in c.values()) for c in collectives.values())):
            raise PackageError("manifest.json: parallel.collectives is not an object of counts per pass and collective")
        return cls(tensor, expert, world, tuple(RankEntry(dict(e["graphs"]), e.get("weights")) for e in ranks),
                   {n: Split.from_json(n, s) for n, s in splits.items()},
                   None if collectives is None else dict(collectives))
