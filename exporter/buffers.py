"""The buffers each pass binds: names, roles, dtypes and symbolic shapes.

Persistent caches are per slot ("slots" symbol, last slot is the session's scratch slot);
staging and per-pass inputs and outputs are per pass row ("rows" symbol). Verify staging
is read again by commit, so staging names are shared between passes.
"""

from __future__ import annotations

from b12x.exporter.dims import Dims
from b12x.exporter.weights import weight_shapes
from b12x.runtime.abi import BufferSpec
from b12x.runtime.layout import staging_shape


def cache_specs(d: Dims) -> list[BufferSpec]:
    specs = []
    for i, ratio in enumerate(d.ratios):
        specs.append(BufferSpec(f"cache.layer{i}.window", "cache", "uint8", ("slots", d.history, d.window_row_bytes)))
        if ratio:
            entries = d.compressed_entries(ratio)
            specs.append(BufferSpec(f"cache.layer{i}.compressed", "cache", "uint8", ("slots", entries, d.compressed_row_bytes)))
        if ratio > 1:
            specs.append(BufferSpec(f"cache.layer{i}.state", "cache", "uint8", ("slots", ratio, d.state_row_bytes)))
    for s in range(d.draft_stages):
        specs.append(BufferSpec(f"cache.draft{s}.window", "cache", "uint8", ("slots", d.history, d.window_row_bytes)))
    specs.append(BufferSpec("cache.seq_len", "cache", "int32", ("slots",)))
    return specs


def window_staging(name: str, d: Dims, width: int) -> BufferSpec:
    shape = staging_shape("rows", d.history + width, d.window_row_bytes, d.layout, d.page_size)
    return BufferSpec(name, "staging", "uint8", tuple(shape))


def verify_staging_specs(d: Dims) -> list[BufferSpec]:
    w = d.verify_width
    specs = []
    for i, ratio in enumerate(d.ratios):
        specs.append(window_staging(f"staging.verify.layer{i}.window", d, w))
        if ratio:
            specs.append(BufferSpec(f"staging.verify.layer{i}.compressed", "staging", "uint8", ("rows", w, d.compressed_row_bytes)))
        if ratio > 1:
            specs.append(BufferSpec(f"staging.verify.layer{i}.state", "staging", "uint8", ("rows", w, d.state_row_bytes)))
    for s in range(d.draft_stages):
        specs.append(BufferSpec(f"staging.verify.draft{s}.context", "staging", "uint8", ("rows", w, d.window_row_bytes)))
    return specs


def draft_staging_specs(d: Dims) -> list[BufferSpec]:
    return [window_staging(f"staging.draft.draft{s}.window", d, d.draft_width) for s in range(d.draft_stages)]


def weight_specs(d: Dims) -> list[BufferSpec]:
    return [BufferSpec(name, "weight", "float32", shape) for name, shape in weight_shapes(d).items()]


def row_input(name: str, *shape) -> BufferSpec:
    return BufferSpec(name, "input", "int32", ("rows", *shape))


def logits_output(d: Dims, width: int) -> BufferSpec:
    return BufferSpec("logits", "output", "float32", ("rows", width, d.vocab))


def family_cache_specs(d: Dims) -> list[BufferSpec]:
    if d.family == "deepseek_v4":
        from b12x.exporter import v4_buffers

        return v4_buffers.cache_specs(d)
    return cache_specs(d)
