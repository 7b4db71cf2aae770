"""Where a package keeps each rank's graphs and weights, and the manifest's `parallel` entry.

One device: `graphs/PASS.pt2` and `weights.safetensors`, and no `parallel` entry (format
4.0, as before parallel packages existed). A parallel recipe: `ranks/R/graphs/PASS.pt2`
and `ranks/R/weights.safetensors` for every rank R, and the mapping as data
(runtime/parallel/mapping.py), format 4.1. Weights in formats other than fp32 (the
manifest's `weights.formats`), on one device or many: format 4.2. A package is written at
the oldest minor that has every field it holds. Every rank's calling conventions must be the
same (equal splits give equal shapes; checked here), so one set of pass entries and one
ABI fingerprint describe them all.
"""

from __future__ import annotations

from b12x_toolchain.exporter.errors import ExportError
from b12x_toolchain.exporter.model.parallel import rank_weights, split_of
from b12x_toolchain.exporter.model.weights import weight_formats, weight_specs
from b12x_toolchain.exporter.pipeline.pass_export import pass_label
from b12x_toolchain.runtime.parallel.mapping import Mapping, RankEntry

SINGLE_DEVICE_FORMAT, PARALLEL_FORMAT, WEIGHT_FORMATS_FORMAT, ENGRAM_FORMAT = "4.0", "4.1", "4.2", "4.3"
TOKENIZER_FORMAT = "4.4"  # a package that carries a tokenizer (export.py), whatever else it holds


class RankFiles:
    def __init__(self, d):
        self.d = d
        parallel = d.world_size > 1
        self.ranks = list(range(d.world_size)) if parallel else [None]
        self.parallel = parallel
        if d.engram is not None:  # the token_history kinds and Engram's tables
            self.format_version = ENGRAM_FORMAT
        elif weight_formats(d):  # what the manifest lists as weights.formats
            self.format_version = WEIGHT_FORMATS_FORMAT
        else:
            self.format_version = PARALLEL_FORMAT if parallel else SINGLE_DEVICE_FORMAT

    @staticmethod
    def graph(name: str, rank: int | None) -> str:
        return f"graphs/{name}.pt2" if rank is None else f"ranks/{rank}/graphs/{name}.pt2"

    @staticmethod
    def weights_file(rank: int | None) -> str:
        return "weights.safetensors" if rank is None else f"ranks/{rank}/weights.safetensors"

    def weights(self, weights: dict | None, rank: int | None) -> dict | None:
        """A rank's shards of the whole model's weights (all of them on one device)."""
        if weights is None or rank is None:
            return weights
        return rank_weights(weights, self.d, rank)

    def check_conventions(self, outputs: dict, pass_names) -> None:
        for name in pass_names:
            first = outputs[pass_label(name, self.ranks[0])]
            for rank in self.ranks[1:]:
                other = outputs[pass_label(name, rank)]
                if (other.inputs, other.outputs) != (first.inputs, first.outputs):
                    raise ExportError(f"pass {name}: rank {rank}'s calling convention differs from rank "
                                      f"{self.ranks[0]}'s; every rank of a mapping must take the same buffers")

    def mapping(self, outputs: dict, pass_names, structural: bool) -> Mapping:
        """The manifest's `parallel` entry: the mapping, each rank's files, collectives per pass."""
        ranks = tuple(RankEntry({name: self.graph(name, rank) for name in pass_names},
                                None if structural else self.weights_file(rank)) for rank in self.ranks)
        splits = {name: split for name in weight_specs(self.d) if (split := split_of(name, self.d)) is not None}
        collectives = {name: outputs[pass_label(name, self.ranks[0])].collectives for name in pass_names}
        return Mapping(self.d.tensor, self.d.expert, self.d.world_size, ranks, splits, collectives)
