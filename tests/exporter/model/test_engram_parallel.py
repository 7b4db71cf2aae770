"""Engram's tables split across tensor ranks by hash head: each rank's shard is its columns' rows,
and its local lookups, side by side over the ranks, are the one-device lookup."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.exporter.model.engram import Engram, column_ranges, hash_primes, prefix, row_ranges, table_rows
from b12x_toolchain.exporter.model.parallel import Mesh, rank_weights, split_of
from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.ops.opset import ops
from b12x_toolchain.runtime.parallel.mapping import Split


def tiny_dims(tiny_recipe, tensor: int = 2) -> Dims:
    return Dims.from_recipe(recipe_variant(tiny_recipe, {"parallel": {"tensor": tensor}}))


def offsets(primes):
    return [sum(primes[:c]) for c in range(len(primes) + 1)]


def test_column_ranges_give_whole_heads_ceil_columns_over_ranks():
    assert column_ranges(24, 8) == [(3 * r, 3 * r + 3) for r in range(8)]
    assert column_ranges(6, 4) == [(0, 2), (2, 4), (4, 6), (6, 6)]  # the last rank holds no column
    assert column_ranges(6, 1) == [(0, 6)]


def test_each_ranks_shard_is_the_rows_of_its_columns(tiny_recipe):
    d = tiny_dims(tiny_recipe)
    whole = init_weights(d, seed=0)
    shards = [rank_weights(whole, d, rank) for rank in range(2)]
    for layer, primes in hash_primes(d).items():
        name, at = prefix(layer) + "embed.weight", offsets(primes)
        split = split_of(name, d)
        assert split.ranges == tuple(row_ranges(d, layer, 2)) and split.ranges[-1][1] == table_rows(d)[layer]
        longest = max(stop - start for start, stop in split.ranges)
        for rank, (first, stop) in enumerate(column_ranges(len(primes), 2)):
            rows = at[stop] - at[first]
            shard = shards[rank][name]
            assert shard.shape == (longest, whole[name].shape[1])
            assert torch.equal(shard[:rows], whole[name][at[first] : at[stop]])
            assert not shard[rows:].any()  # zero padding up to the longest shard


def random_row_ids(primes, shape, generator):
    at = offsets(primes)
    return torch.stack([at[c] + torch.randint(0, p, shape, generator=generator) for c, p in enumerate(primes)], -1)


class Capture:
    """A mesh that records each rank's local lookup instead of gathering it."""

    def __init__(self, tensor, rank):
        self.tensor, self.rank, self.local = tensor, rank, None

    def gather_last(self, x):
        self.local = x
        return x


@pytest.mark.parametrize("tensor", [2, 4])  # 4 ranks over 6 columns: a padding column, a rank without any
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_local_lookups_side_by_side_are_the_one_device_lookup(tiny_recipe, tensor, fp8):
    d = tiny_dims(tiny_recipe)
    g = torch.Generator().manual_seed(0)
    hd = d.engram.head_dim
    for layer, primes in hash_primes(d).items():
        rows = table_rows(d)[layer]
        table = torch.randn(rows, hd, generator=g)
        scale = None
        if fp8:
            table = table.to(torch.float8_e4m3fn)
            scale = torch.randint(120, 134, (rows, hd // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        ids = random_row_ids(primes, (2, 5), g)
        expected = ops.engram_lookup(table, scale, ids)
        split = Split(0, tensor, ranges=tuple(row_ranges(d, layer, tensor)))
        pieces = []
        for rank in range(tensor):
            mesh = Capture(tensor, rank)
            Engram(d, None, mesh).lookup(layer, split.take(table, rank),
                                         None if scale is None else split.take(scale, rank), ids)
            pieces.append(mesh.local)
        got = torch.cat(pieces, -1)[..., : len(primes) * hd]  # the all-gather, padding columns dropped
        assert torch.equal(got.view(torch.uint8) if fp8 else got, expected.view(torch.uint8) if fp8 else expected)


def test_on_one_device_the_lookup_is_the_tables(tiny_recipe):
    d = tiny_dims(tiny_recipe, 1)
    table, ids = torch.randn(7, d.engram.head_dim), torch.tensor([[[0, 3, 6]]])
    for mesh in (None, Mesh()):
        assert torch.equal(Engram(d, None, mesh).lookup(1, table, None, ids), ops.engram_lookup(table, None, ids))


def test_a_split_with_ranges_round_trips_and_malformed_ranges_are_refused():
    split = Split(0, 2, ranges=((0, 5), (5, 8)))
    assert Split.from_json("t", split.to_json()) == split
    assert split.shape((8, 4)) == (5, 4) and split.whole((5, 4)) == (8, 4)
    assert torch.equal(split.take(torch.arange(8.0)[:, None], 1), torch.tensor([[5.0], [6.0], [7.0], [0.0], [0.0]]))
    for ranges in ([[0, 5]], [[0, 5], [6, 8]], [[1, 5], [5, 8]], [[0, 5], [5, 4]], [[0, 0], [0, 0]], "0-8",
                   [[0, 5], [5, True]]):
        with pytest.raises(PackageError, match="ranges"):
            Split.from_json("t", {**split.to_json(), "ranges": ranges})
    with pytest.raises(PackageError, match="ranges"):
        Split.from_json("t", {**split.to_json(), "halves": True})
