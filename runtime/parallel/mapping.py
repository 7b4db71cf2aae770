"""A package's parallel mapping, as the manifest records it: ranks, their files, and how each
weight is split.

    "parallel": {"tensor": 2, "expert": 2, "world_size": 2,
                 "ranks": [{"graphs": {"verify": "ranks/0/graphs/verify.pt2", ...},
                            "weights": "ranks/0/weights.safetensors"}, ...],
                 "splits": {"lm_head.weight": {"axis": 0, "parts": 2, "halves": false},
                            "model.layers.1.engram.embed.weight":
                                {"axis": 0, "parts": 2, "halves": false, "ranges": [[0, 3003], [3003, 6012]]}, ...},
                 "collectives": {"verify": {"all_reduce": 16}, ...}}

A package exported for one device has no `parallel` entry. `splits` is what lets a
runtime cut a rank's shard out of a whole checkpoint without the exporter's shard plan:
the rule is data, applied by `Split.take`. A split with `ranges` (an Engram table, split by
hash head) gives rank r the rows [start, stop) of its range, padded with zero rows to the
longest range, so every rank's tensor has one shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from b12x_toolchain.runtime.errors import PackageError


@dataclass(frozen=True)
class Split:
    """A weight cut into `parts` equal pieces along `axis`; rank r holds piece r. With `halves`
    the axis holds two stacked halves (an expert's gate then up), each cut on its own. With
    `ranges` (one [start, stop) per part, tiling the axis from 0 in order) piece r is that
    range of the axis, padded with zeros to the longest range's length."""

    axis: int
    parts: int
    halves: bool = False
    ranges: tuple[tuple[int, int], ...] | None = None

    def take(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        if self.ranges is not None:
            start, stop = self.ranges[index]
            piece = tensor.narrow(self.axis, start, stop - start)
            padding = list(piece.shape)
            padding[self.axis] = self.longest - (stop - start)
            return torch.cat([piece, piece.new_zeros(padding)], dim=self.axis).contiguous()
        pieces = tensor.chunk(2, dim=self.axis) if self.halves else (tensor,)
        return torch.cat([p.chunk(self.parts, dim=self.axis)[index] for p in pieces], dim=self.axis).contiguous()

    @property
    def longest(self) -> int:
        """The length of the longest range (ranges only): every piece's, padding included."""
        return max(stop - start for start, stop in self.ranges)

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        size = self.longest if self.ranges is not None else shape[self.axis] // self.parts
        return shape[: self.axis] + (size,) + shape[self.axis + 1 :]

    def whole(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the tensor a piece of `shape` was cut from."""
        size = self.ranges[-1][1] if self.ranges is not None else shape[self.axis] * self.parts
        return shape[: self.axis] + (size,) + shape[self.axis + 1 :]

    def to_json(self) -> dict:
        out = {"axis": self.axis, "parts": self.parts, "halves": self.halves}
        if self.ranges is not None:
            out["ranges"] = [list(r) for r in self.ranges]
        return out

    @classmethod
    def from_json(cls, name: str, data) -> "Split":
        keys = {"axis", "parts", "halves"}
        if not isinstance(data, dict) or set(data) not in (keys, keys | {"ranges"}):
            raise PackageError(f"manifest.json: parallel.splits.{name} is not {{axis, parts, halves[, ranges]}}")
        axis, parts, halves = data["axis"], data["parts"], data["halves"]
        if not (_count(axis) and _count(parts) and parts >= 1 and isinstance(halves, bool)):
            raise PackageError(f"manifest.json: parallel.splits.{name} = {data!r}; expected a non-negative axis, "
                               "a positive number of parts and a boolean")
        if "ranges" not in data:
            return cls(axis, parts, halves)
        ranges = data["ranges"]
        if halves or not _tiling(ranges, parts):
            raise PackageError(f"manifest.json: parallel.splits.{name}.ranges = {ranges!r}; expected {parts} "
                               "[start, stop] ranges tiling the axis from 0 in order (not all empty), "
                               "without halves")
        return cls(axis, parts, halves, tuple((start, stop) for start, stop in ranges))


def _tiling(ranges, parts: int) -> bool:
    """`ranges` is `parts` [start, stop] pairs, each starting where the last stopped (the first at 0),
    with at least one non-empty range."""
    if not (isinstance(ranges, list) and len(ranges) == parts
            and all(isinstance(r, list) and len(r) == 2 and all(map(_count, r)) for r in ranges)):
        return False
    stops = [0] + [stop for _, stop in ranges]
    return all(start == stops[i] and stop >= start for i, (start, stop) in enumerate(ranges)) and stops[-1] > 0


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
