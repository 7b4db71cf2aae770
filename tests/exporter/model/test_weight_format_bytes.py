"""Weights in their formats across ranks: data and scales split together on block boundaries, and
the per-rank bytes (`export.parallel`) follow the formats."""

from __future__ import annotations

import math

import pytest

from b12x_toolchain.exporter.model.parallel import rank_weight_specs, split_of, weight_bytes
from b12x_toolchain.exporter.model.weights import SCALE_SUFFIX, logical_specs, weight_formats
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe, parse_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from decode_steps import FP32_WEIGHTS
from recipe_text import TINY_TEXT

FP8_32 = "{format: fp8_e4m3, block: [32, 32], scale: ue8m0}"
# DeepSeek V4.1's release: FP8 32x32 UE8M0 linears, FP4 routed experts, BF16 embeddings, head,
# compressors, router and norms; sinks, mHC and biases stay fp32.
V41_RELEASE = f"""weights:
  attention: {FP8_32}
  indexer_query: {FP8_32}
  shared_experts: {FP8_32}
  routed_experts: fp4_e2m1
  draft_input: {FP8_32}
  head: bf16
  embeddings: bf16
  compressor: bf16
  router: bf16
  norms: bf16
  draft_heads: bf16
  engram_tables: {{format: fp8_e4m3, block: [1, 32], scale: ue8m0}}
  engram_projection: {FP8_32}
"""
GiB = 2**30


def dims(text: str, parallel: str) -> Dims:
    return Dims.from_recipe(parse_recipe(text + f"parallel: {parallel}\n" + V41_RELEASE, "t.yaml"))


@pytest.mark.parametrize("parallel", ["{tensor: 2}", "{expert: 2}", "{tensor: 2, expert: 2}"])
def test_a_ranks_scales_are_the_scale_grid_of_its_shard(parallel):
    d = dims(TINY_TEXT, parallel)
    logical, ranks = logical_specs(d), rank_weight_specs(d)
    formats = {n: f for n, f in weight_formats(d).items() if f.quantized}
    assert formats
    for name, fmt in formats.items():
        split = split_of(name, d)
        shard = split.shape(logical[name][0]) if split else logical[name][0]
        assert ranks[name] == (fmt.data_shape(shard), fmt.data_dtype), name
        assert ranks[name + SCALE_SUFFIX] == (fmt.scale_shape(shard), fmt.scale_dtype), name
        assert split_of(name + SCALE_SUFFIX, d) == split, name


def test_per_rank_bytes_follow_the_formats():
    d = dims(TINY_TEXT, "{tensor: 2, expert: 2}")
    ranks = rank_weight_specs(d)
    # Two of four experts a rank, FP4: [2, 256, 128] -> 2 x 256 x (64 data + 4 scale) bytes.
    up = "model.layers.0.mlp.experts.gate_up_proj"
    assert ranks[up] == ((2, 256, 64), "int8") and ranks[up + SCALE_SUFFIX] == ((2, 256, 4), "float8_e8m0fnu")
    # q_b_proj [128, 64] column-parallel: 64 rows a rank, 2 x 2 blocks of 32.
    q = "model.layers.0.self_attn.q_b_proj.weight"
    assert ranks[q] == ((64, 64), "float8_e4m3fn") and ranks[q + SCALE_SUFFIX] == ((2, 2), "float8_e8m0fnu")
    # Every rank holds its shard of the split weights and all of the others, in stored bytes; an
    # Engram table's shard is its longest range of rows (padded), the others half of the weight.
    expected = tables = 0
    for name, (shape, dtype) in logical_specs(d).items():
        fmt, split = weight_formats(d).get(name), split_of(name, d)
        if split is not None and split.ranges is not None:
            shape = split.shape(shape)
        size = fmt.nbytes(shape) if fmt else math.prod(shape) * (8 if dtype == "int64" else 4)
        expected += size // 2 if split is not None and split.ranges is None else size
        tables += size if "engram.embed" in name else 0
    sizes = weight_bytes(d)
    assert tables and sizes["per_rank"] == expected and sizes["per_rank_host"] == tables
    assert sizes["per_rank_device"] == expected - tables


def test_full_size_v41_in_its_release_formats_fits_eight_ways():
    # The bundled dsv41 stores the release's formats, under DeepSeek's activation rule.
    bundled = load_recipe("dsv41")
    release = parse_recipe(TINY_TEXT + V41_RELEASE, "t.yaml").normalized()["weights"]
    assert bundled.normalized()["weights"] == {**release, "activation": "deepseek"}
    eight = {"parallel": {"tensor": 8, "expert": 8}}
    fp32 = weight_bytes(Dims.from_recipe(recipe_variant(bundled, {**eight, **FP32_WEIGHTS})))
    native = weight_bytes(Dims.from_recipe(recipe_variant(bundled, eight)))
    total = native["sharded_ideal"] * 8 + native["replicated"]
    # Per rank, GiB: fp32 254.98 (163.43 on the device + 91.56 of Engram tables); the release
    # formats 46.64 with the tables on the device, or 23.04 on the device + 23.60 in pinned host
    # memory with engram_tables="host" (the tables, ~203 GB in all, split by hash head).
    assert round(fp32["per_rank"] / GiB, 2) == 254.98 and round(fp32["per_rank_device"] / GiB, 2) == 163.43
    assert native["per_rank"] <= 1.15 * total / 8, native["per_rank"] / GiB
    assert native["per_rank"] == native["per_rank_device"] + native["per_rank_host"]
    # The figures docs/model.md and docs/deployment.md quote; an H200 (141 GB) holds a rank's weights either
    # way, and with the tables on the host the device keeps what it held before Engram, give or take its projections.
    assert [round(native[k] / GiB, 2) for k in ("per_rank", "per_rank_device", "per_rank_host")] == [46.64, 23.04, 23.6]
    assert native["per_rank_device"] / GiB < 24
