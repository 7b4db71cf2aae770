"""The buffers DeepSeek V4 / V4.1 passes bind: names, roles, dtypes and symbolic shapes.

Per slot and target layer: the window ring; where the layer owns compressed caches (V4:
every compressed layer; V4.1: Full layers only), the compressed entries (one per `ratio`
positions), the index keys (V4 CSA, V4.1 Full) and the compressor's state ring of raw
[kv | gate] rows (`span` rows: the open group, plus the previous group where CSA
overlaps; V4.1's ratio-1 layers need none). Reindex and Reuse layers own only their
window. The drafter adds its own caches.

Persistent caches are per slot ("slots" symbol, last slot is the session's scratch slot);
staging and per-pass inputs and outputs are per pass row ("rows" symbol). Verify staging
is read again by commit, so staging names are shared between passes.
"""

from __future__ import annotations

from b12x_toolchain.exporter.model.cache_io import STATE_FORMAT
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.model.weights import weight_specs as weight_shapes_dtypes
from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.formats.layout import staging_shape


def state_span(kind: str, ratio: int) -> int:
    return 2 * ratio if kind == "csa" else ratio


def owned_caches(d: Dims, i: int) -> list[tuple[str, str, int, int]]:
    """(name, what, rows per slot, row bytes) of layer i's caches; what: window, entries, state."""
    ratio, kind = d.ratios[i], d.kind(i)
    out = [(f"layer{i}.window", "window", d.history, d.window_row_bytes)]
    if d.role(i) != "full":
        return out
    entries = d.max_seq_len // ratio
    out.append((f"layer{i}.compressed", "entries", entries, d.compressed_row_bytes))
    if kind != "direct":
        width = 4 * d.head_dim if kind == "csa" else 2 * d.head_dim  # [kv | gate], two series where CSA overlaps
        out.append((f"layer{i}.state", "state", state_span(kind, ratio), get_format(STATE_FORMAT).row_bytes(width)))
    if kind == "csa" or not d.v4:
        out.append((f"layer{i}.index", "entries", entries, get_format(d.index_format).row_bytes(d.index_head_dim)))
    if kind == "csa":
        out.append((f"layer{i}.index_state", "state", state_span(kind, ratio),
                    get_format(STATE_FORMAT).row_bytes(4 * d.index_head_dim)))
    return out


def cache_specs(d: Dims, drafter) -> list[BufferSpec]:
    specs = [BufferSpec(f"cache.{name}", "cache", "uint8", ("slots", rows, nbytes))
             for i in range(d.layers) for name, _, rows, nbytes in owned_caches(d, i)]
    return specs + drafter.cache_specs() + [BufferSpec("cache.seq_len", "cache", "int32", ("slots",))]


def verify_staging_specs(d: Dims, drafter) -> list[BufferSpec]:
    w, specs = d.verify_width, []
    for i in range(d.layers):
        for name, what, _, nbytes in owned_caches(d, i):
            if what == "window":
                specs.append(window_staging(f"staging.verify.{name}", d, w))
            else:
                specs.append(BufferSpec(f"staging.verify.{name}", "staging", "uint8", ("rows", w, nbytes)))
    return specs + drafter.verify_staging_specs()


def weight_specs(d: Dims) -> list[BufferSpec]:
    return [BufferSpec(name, "weight", dtype, shape) for name, (shape, dtype) in weight_shapes_dtypes(d).items()]


def window_staging(name: str, d: Dims, width: int) -> BufferSpec:
    shape = staging_shape("rows", d.history + width, d.window_row_bytes, d.layout, d.page_size)
    return BufferSpec(name, "staging", "uint8", tuple(shape))


def row_input(name: str, *shape) -> BufferSpec:
    return BufferSpec(name, "input", "int32", ("rows", *shape))
