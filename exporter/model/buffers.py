"""The buffers DeepSeek V4 / V4.1 passes bind: names, roles, dtypes, symbolic shapes, and
what each one is (kind, layer or draft stage, row format, dims, ratio: contract.py).

Per slot and target layer: the window ring; where the layer owns compressed caches (V4:
every compressed layer; V4.1: Full layers only), the compressed entries (one per `ratio`
positions), the index keys (V4 CSA, V4.1 Full) and the compressor's state ring of raw
[kv | gate] rows (`span` rows: the open group, plus the previous group where CSA
overlaps; V4.1's ratio-1 layers need none). Reindex and Reuse layers own only their
window. The drafter adds its own caches.

Compressed entries and index keys are paged: [pool, page_bytes] caches whose pages the
caller owns, one pool and block table per kind (`tokens_per_page` from the recipe), so
their memory follows the tokens requests hold. Rings (window, compressor state) stay per
slot ("slots" symbol, last slot is the session's scratch slot): `history` rows per slot,
whatever `max_seq_len` is, so paging them would not make memory follow tokens. Staging
and per-pass inputs and outputs are per pass row ("rows" symbol). Verify staging
is read again by commit, so staging names are shared between passes. Names are labels
for binding: what a buffer is travels as its info, which the manifest records as data.
"""

from __future__ import annotations

from typing import NamedTuple

from b12x_toolchain.exporter.model import buffer_names as names
from b12x_toolchain.exporter.model.cache_io import STATE_FORMAT
from b12x_toolchain.exporter.model.parallel import rank_weight_specs as weight_shapes_dtypes
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.formats.layout import staging_shape
from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.package.contract import BufferInfo, CachePages, PageSpec
from b12x_toolchain.runtime.package.kinds import KINDS, block_table_kind

# The staging kind that holds, per position of a verify pass, the rows of a cache kind.
STAGING_KIND = {
    "window_ring": "window_staging",
    "compressed_entries": "entry_staging",
    "index_keys": "index_key_staging",
    "compressor_state": "state_staging",
    "index_compressor_state": "index_state_staging",
}


class Owned(NamedTuple):
    """One cache of a target layer: `rows` rows per slot of `dims` values in `fmt`."""

    name: str  # without the cache or staging prefix (buffer_names.local)
    kind: str
    rows: int
    fmt: str
    dims: int
    ratio: int  # positions per row

    @property
    def row_bytes(self) -> int:
        return get_format(self.fmt).row_bytes(self.dims)


def state_span(kind: str, ratio: int) -> int:
    return 2 * ratio if kind == "csa" else ratio


def owned_caches(d: Dims, i: int) -> list[Owned]:
    ratio, kind = d.ratios[i], d.kind(i)

    def owned(cache_kind: str, *rows_format_dims_ratio) -> Owned:
        return Owned(names.local(cache_kind, names.layer(i)), cache_kind, *rows_format_dims_ratio)

    out = [owned("window_ring", d.history, d.window_format, d.head_dim, 1)]
    if d.role(i) != "full":
        return out
    entries = d.max_seq_len // ratio
    out.append(owned("compressed_entries", entries, d.compressed_format, d.head_dim, ratio))
    if kind != "direct":
        width = 4 * d.head_dim if kind == "csa" else 2 * d.head_dim  # [kv | gate], two series where CSA overlaps
        out.append(owned("compressor_state", state_span(kind, ratio), STATE_FORMAT, width, 1))
    if kind == "csa" or not d.v4:
        out.append(owned("index_keys", entries, d.index_format, d.index_head_dim, ratio))
    if kind == "csa":
        out.append(owned("index_compressor_state", state_span(kind, ratio), STATE_FORMAT, 4 * d.index_head_dim, 1))
    return out


def page_tokens(d: Dims, kind: str) -> int:
    return {"compressed_entries": d.entry_page_tokens, "index_keys": d.index_page_tokens}[kind]


def cache_pages(d: Dims, kind: str, fmt: str, dims: int, ratio: int) -> CachePages:
    tokens, record = page_tokens(d, kind), get_format(fmt).row_bytes(dims)
    return CachePages(KINDS[kind].pool, ratio, tokens, tokens // ratio, record, tokens // ratio * record, record,
                      -(-d.max_seq_len // tokens))


def paged_cache(d: Dims, name: str, c: Owned, layer: int) -> BufferSpec:
    pages = cache_pages(d, c.kind, c.fmt, c.dims, c.ratio)
    info = BufferInfo(c.kind, layer, None, c.fmt, c.dims, c.ratio, page=pages)
    return BufferSpec(name, "cache", "uint8", (pages.pool, pages.page_bytes), info)


def cache(name: str, kind: str, rows: int, fmt: str, dims: int, *, layer=None, stage=None, ratio: int = 1) -> BufferSpec:
    """A per-slot cache: `rows` rows per slot."""
    info = BufferInfo(kind, layer, stage, fmt, dims, ratio, rows)
    return BufferSpec(name, "cache", "uint8", ("slots", rows, get_format(fmt).row_bytes(dims)), info)


def block_tables(caches) -> list[BufferSpec]:
    """One block table per page pool the `caches` use: int32 [rows, pages_per_slot]."""
    widths = {s.info.page.pool: s.info.page.pages_per_slot for s in caches if isinstance(s.info.page, CachePages)}
    return [row_input(block_table_kind(pool), width) for pool, width in sorted(widths.items())]


def staged_rows(name: str, kind: str, width: int, fmt: str, dims: int, *, layer=None, stage=None,
                ratio: int = 1) -> BufferSpec:
    """Staging of one row per position of a `width`-wide pass; `ratio` is that of the cache it feeds."""
    info = BufferInfo(kind, layer, stage, fmt, dims, ratio)
    return BufferSpec(name, "staging", "uint8", ("rows", width, get_format(fmt).row_bytes(dims)), info)


def window_staging(name: str, d: Dims, width: int, *, layer=None, stage=None) -> BufferSpec:
    """History snapshot plus `width` appended window rows, paged (runtime/formats/layout.py)."""
    kind = "window_staging" if stage is None else "draft_window_staging"
    info = BufferInfo(kind, layer, stage, d.window_format, d.head_dim, 1, page=PageSpec(d.layout, d.page_size))
    shape = staging_shape("rows", d.history + width, d.window_row_bytes, d.layout, d.page_size)
    return BufferSpec(name, "staging", "uint8", tuple(shape), info)


SEQ_LEN = BufferSpec(names.SEQ_LEN, "cache", "int32", ("slots",), BufferInfo("seq_len"))


def token_history(d: Dims) -> Owned | None:
    """Engram's per-slot ring of compressed token ids (exporter/model/engram.py); None without Engram."""
    if d.engram is None:
        return None
    return Owned(names.ENGRAM_HISTORY, "token_history", d.engram.max_ngram, STATE_FORMAT, 1, 1)


def cache_specs(d: Dims, drafter) -> list[BufferSpec]:
    specs = [paged_cache(d, names.cache(c.name), c, i) if KINDS[c.kind].pool is not None
             else cache(names.cache(c.name), c.kind, c.rows, c.fmt, c.dims, layer=i, ratio=c.ratio)
             for i in range(d.layers) for c in owned_caches(d, i)]
    history = token_history(d)
    if history is not None:
        specs.append(cache(names.cache(history.name), history.kind, history.rows, history.fmt, history.dims))
    return specs + drafter.cache_specs() + [SEQ_LEN]


def verify_staging_specs(d: Dims, drafter) -> list[BufferSpec]:
    w, specs = d.verify_width, []
    for i in range(d.layers):
        for c in owned_caches(d, i):
            if c.kind == "window_ring":
                specs.append(window_staging(names.staging("verify", c.name), d, w, layer=i))
            else:
                specs.append(staged_rows(names.staging("verify", c.name), STAGING_KIND[c.kind], w, c.fmt, c.dims,
                                         layer=i, ratio=c.ratio))
    history = token_history(d)
    if history is not None:
        specs.append(staged_rows(names.staging("verify", history.name), "token_history_staging", w, history.fmt,
                                 history.dims))
    return specs + drafter.verify_staging_specs()


def weight_specs(d: Dims) -> list[BufferSpec]:
    return [BufferSpec(name, "weight", dtype, shape) for name, (shape, dtype) in weight_shapes_dtypes(d).items()]


def row_input(kind: str, *shape) -> BufferSpec:
    return BufferSpec(names.row_input(kind), "input", "int32", ("rows", *shape), BufferInfo(kind))
