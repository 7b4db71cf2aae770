"""The buffers DeepSeek V4 passes bind.

Per slot and target layer: the window ring; for compressed layers the compressed entries
(one per `ratio` positions) and the compressor's state ring of raw [kv | gate] rows
(`span` rows: the open group, plus the previous group where CSA overlaps); CSA layers also
keep their indexer's keys and state. The MTP stage keeps its window ring and the target's
last committed streams (its input for the next position).
"""

from __future__ import annotations

from b12x.exporter.buffers import row_input, window_staging
from b12x.exporter.dims import Dims
from b12x.exporter.v4_weights import v4_weight_specs
from b12x.runtime.abi import BufferSpec
from b12x.runtime.formats import get_format


def compressed_layers(d: Dims):
    """(layer, kind, ratio) for every compressed target layer."""
    return [(i, d.v4.kind(r), r) for i, r in enumerate(d.ratios) if r]


def state_span(kind: str, ratio: int) -> int:
    return 2 * ratio if kind == "csa" else ratio


def state_width(d: Dims, kind: str, dim: int) -> int:
    """Floats in one state row: [kv | gate], each two series wide where CSA overlaps."""
    return 4 * dim if kind == "csa" else 2 * dim


def hidden_width(d: Dims) -> int:
    return d.v4.hc_mult * d.hidden


def _bytes(fmt: str, dim: int) -> int:
    return get_format(fmt).row_bytes(dim)


def _per_layer(d: Dims, rows_of):
    """(name suffix, rows, row bytes) of every per-layer cache; rows_of(kind, ratio, what)."""
    v = d.v4
    out = []
    for i, ratio in enumerate(d.ratios):
        out.append((f"layer{i}.window", rows_of("window", ratio), _bytes(d.window_format, d.head_dim)))
        if not ratio:
            continue
        kind = v.kind(ratio)
        out.append((f"layer{i}.compressed", rows_of("entries", ratio), _bytes(d.compressed_format, d.head_dim)))
        out.append((f"layer{i}.state", rows_of(("state", kind), ratio), _bytes("fp32", state_width(d, kind, d.head_dim))))
        if kind == "csa":
            out.append((f"layer{i}.index", rows_of("entries", ratio), _bytes(v.index_format, v.index_head_dim)))
            out.append((f"layer{i}.index_state", rows_of(("state", kind), ratio),
                        _bytes("fp32", state_width(d, kind, v.index_head_dim))))
    return out


def cache_specs(d: Dims) -> list[BufferSpec]:
    def rows_of(what, ratio):
        if what == "window":
            return d.history
        if what == "entries":
            return d.max_seq_len // ratio
        return state_span(what[1], ratio)

    specs = [BufferSpec(f"cache.{name}", "cache", "uint8", ("slots", rows, nbytes))
             for name, rows, nbytes in _per_layer(d, rows_of)]
    for s in range(d.draft_stages):
        specs.append(BufferSpec(f"cache.draft{s}.window", "cache", "uint8",
                                ("slots", d.history, _bytes(d.window_format, d.head_dim))))
        specs.append(BufferSpec(f"cache.draft{s}.hidden", "cache", "uint8",
                                ("slots", 1, _bytes("fp32", hidden_width(d)))))
    specs.append(BufferSpec("cache.seq_len", "cache", "int32", ("slots",)))
    return specs


def verify_staging_specs(d: Dims) -> list[BufferSpec]:
    w = d.verify_width
    specs = []
    for name, _, nbytes in _per_layer(d, lambda what, ratio: w):
        if name.endswith(".window"):
            specs.append(window_staging(f"staging.verify.{name}", d, w))
        else:
            specs.append(BufferSpec(f"staging.verify.{name}", "staging", "uint8", ("rows", w, nbytes)))
    for s in range(d.draft_stages):
        specs.append(BufferSpec(f"staging.verify.draft{s}.context", "staging", "uint8",
                                ("rows", w, _bytes(d.window_format, d.head_dim))))
        specs.append(BufferSpec(f"staging.verify.draft{s}.hidden", "staging", "uint8",
                                ("rows", w, _bytes("fp32", hidden_width(d)))))
    return specs


def draft_staging_specs(d: Dims) -> list[BufferSpec]:
    return [window_staging(f"staging.draft.draft{s}.window", d, d.draft_width) for s in range(d.draft_stages)]


def weight_specs(d: Dims) -> list[BufferSpec]:
    return [BufferSpec(name, "weight", dtype, shape) for name, (shape, dtype) in v4_weight_specs(d).items()]


__all__ = ["cache_specs", "verify_staging_specs", "draft_staging_specs", "weight_specs", "row_input"]
