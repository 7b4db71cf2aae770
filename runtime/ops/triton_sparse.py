"""Triton kernel for `sparse_attention`, and the entry-row loader the indexer shares.

Compressed entries are addressed by id: ids below `committed = positions[r] // ratio` are
decoded in-kernel with `triton_codecs.load_rows` (the same decoders as every other kernel,
bit-exact with the formats) from the paged cache [pages, page_bytes], entry `j` in page
`block_table[r, j // entries_per_page]` at record `j % entries_per_page`, the page id
loaded per entry; this pass's ids come from the fp32 `new` rows, entry `j` at pass row
`(j + 1) * ratio - 1 - positions[r]`. A kernel touches only ids a length allows, so bytes
past the committed length are never loaded (poisoned ones change nothing) and the
capacity a block table addresses costs nothing.

`sparse_attention` is one launch: one program per (row, pass token, block of heads) runs
an online softmax over the window rows its query sees, in tiles anchored at absolute
positions, then over its entries (the listed ids, or every id below its visible count, in
tiles from id 0), starting from the sink's logit: a query's result does not depend on the
pass, the rows or the keys its pass holds besides its own. No host sync
and a static output shape, so a CUDA graph captures it. Dot products use IEEE fp32
(`input_precision="ieee"`, not TF32): the result must stay within 1e-5 of the fp32
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.ops.triton_codecs import load_rows
from b12x_toolchain.runtime.ops.triton_rows import as_units, format_code

MIN_DOT = 16  # tl.dot needs every tile side at least this on a GPU


def dot_tile(dim_p2: int, budget: int = 4096) -> int:
    """Rows per [rows, dim] tile: about `budget` elements, at least MIN_DOT, at most 64."""
    return max(MIN_DOT, min(64, budget // dim_p2))


@triton.jit
def entry_tile(cache, c_p, c_e, per_page, table, cap, new, n_r, n_t, r, ids, ok, committed, pos, T,
               RATIO: tl.constexpr, FMT: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr,
               TOK: tl.constexpr):
    """float32 [TOK, DIM_P2] rows of entries `ids` [TOK] of row r where ok (0 elsewhere).

    Stored ids (below `committed`, and below the row's capacity `cap` = block table width *
    per_page so a bad length cannot read past its table) are decoded from the page
    `table[id // per_page]` names, record `id % per_page` (c_p, c_e: page and record
    strides in cache units); an unmapped page (-1) reads as nothing rather than out of
    bounds. Later ids are this pass's rows of `new`.
    """
    ids64 = ids.to(tl.int64)
    stored = ok & (ids < committed) & (ids < cap)
    page = tl.load(table + ids64 // per_page, mask=stored, other=-1).to(tl.int64)
    stored = stored & (page >= 0)
    at = cache + page * c_p + (ids64 % per_page) * c_e
    x = load_rows(at[:, None], stored[:, None], FMT, DIM, DIM_P2, TOK)
    row = (ids64 + 1) * RATIO - 1 - pos
    fresh = ok & (ids >= committed) & (row < T)
    d = tl.arange(0, DIM_P2)[None, :]
    y = tl.load(new + r * n_r + row[:, None] * n_t + d, mask=fresh[:, None] & (d < DIM), other=0.0)
    return tl.where(fresh[:, None], y, x)


def paged_args(cache, block_table, code: int, dim: int, fmt: str):
    """(cache units, block table, (c_p, c_e, per_page, table row stride, cap)): what the
    kernels need to address a paged cache [pages, page_bytes] of `fmt` records of `dim` values."""
    record_bytes = get_format(fmt).row_bytes(dim)  # rejects a dim the format cannot hold, as the reference
    units = as_units(cache, code)
    table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    per_page = cache.shape[1] // record_bytes
    strides = (units.stride(0), record_bytes // units.element_size(), per_page, table.stride(0),
               table.shape[1] * per_page)
    return units, table, strides


@triton.jit
def _online_step(qt, keys, seen, m, l, acc, scale):
    """One tile of the online softmax (K = V): logits of the rows seen, running max m,
    denominator l and weighted sum acc rescaled to the new max."""
    logits = tl.dot(qt, tl.trans(keys), input_precision="ieee") * scale
    logits = tl.where(seen[None, :], logits, float("-inf"))
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(logits - m_new[:, None])  # exactly 0 where not seen: m_new is finite
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, keys, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _attention(q, window, visible, sinks, cache, new, block_table, positions, indices, out,
               T, S, K, c_p, c_e, per_page, t_r, cap, n_r, n_t, scale,
               H: tl.constexpr, BLOCK_H: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr,
               RATIO: tl.constexpr, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
               ENTRIES: tl.constexpr, LISTED: tl.constexpr):
    """Program (r * T + t, head block): out[r, t, heads] over window, entries and sink."""
    rt = tl.program_id(0)
    r = rt // T
    t = rt % T
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, DIM_P2)
    head_ok = (h < H)[:, None]
    dim_ok = (d < DIM)[None, :]
    q_at = (rt.to(tl.int64) * H + h[:, None]) * DIM + d[None, :]
    qt = tl.load(q + q_at, mask=head_ok & dim_ok, other=0.0)
    # The sink is one more logit that returns nothing: it starts the running max, and its
    # exp(sink - max) = 1 is the denominator's first term. A finite start also keeps
    # exp(-inf - max) at 0 for tiles where nothing is seen.
    m = tl.load(sinks + h, mask=h < H, other=0.0).to(tl.float32)
    l = tl.full((BLOCK_H,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_H, DIM_P2), tl.float32)
    # Window row s holds position first + s; tiles start at multiples of BLOCK_N positions, so
    # a query meets its keys in the same tiles, at the same places, in every pass (a tile it
    # sees nothing of changes no bit), whatever rows the pass holds before them.
    first = tl.load(positions + r).to(tl.int32) - (S - T)
    shift = ((first % BLOCK_N) + BLOCK_N) % BLOCK_N
    for start in range(-shift, S, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)
        seen = tl.load(visible + rt.to(tl.int64) * S + s, mask=(s >= 0) & (s < S), other=0) != 0
        # Only rows this query sees are loaded: stale window rows never meet 0 * NaN.
        at = (r.to(tl.int64) * S + s[:, None]) * DIM + d[None, :]
        keys = tl.load(window + at, mask=seen[:, None] & dim_ok, other=0.0)
        m, l, acc = _online_step(qt, keys, seen, m, l, acc, scale)
    if ENTRIES:
        pos = tl.load(positions + r).to(tl.int32)
        committed = pos // RATIO
        table = block_table + r.to(tl.int64) * t_r  # this row's pages
        if LISTED:
            for start in range(0, K, BLOCK_N):
                k = start + tl.arange(0, BLOCK_N)
                ids = tl.load(indices + rt.to(tl.int64) * K + k, mask=k < K, other=-1).to(tl.int32)
                ok = ids >= 0
                keys = entry_tile(cache, c_p, c_e, per_page, table, cap, new, n_r, n_t, r, ids, ok, committed,
                                  pos, T, RATIO, FMT, DIM, DIM_P2, BLOCK_N)
                m, l, acc = _online_step(qt, keys, ok, m, l, acc, scale)
        else:
            below = (pos + t + 1) // RATIO  # the loop runs to this query's length, not the capacity
            for start in range(0, below, BLOCK_N):
                ids = start + tl.arange(0, BLOCK_N)
                ok = ids < below
                keys = entry_tile(cache, c_p, c_e, per_page, table, cap, new, n_r, n_t, r, ids, ok, committed,
                                  pos, T, RATIO, FMT, DIM, DIM_P2, BLOCK_N)
                m, l, acc = _online_step(qt, keys, ok, m, l, acc, scale)
    tl.store(out + q_at, acc / l[:, None], mask=head_ok & dim_ok)


def sparse_attention(q, window, window_visible, sinks, entry_cache, new_entries, block_table, positions,
                     indices, ratio: int, fmt: str) -> torch.Tensor:
    R, T, H, D = q.shape
    out = torch.empty(R, T, H, D, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    entries = entry_cache is not None
    q = q.to(torch.float32).contiguous()
    window = window.to(torch.float32).contiguous()
    visible = window_visible.contiguous().view(torch.uint8)  # bool bytes, read as 0 / 1
    sinks = sinks.to(torch.float32).contiguous()
    listed = entries and indices is not None
    K = indices.shape[-1] if listed else 0
    indices = indices.contiguous() if listed else out
    if entries:
        code = format_code(fmt)
        cache, table, paged = paged_args(entry_cache, block_table, code, D, fmt)
        new = new_entries.to(torch.float32)
        new = new if new.stride(-1) == 1 else new.contiguous()
        cache_args = (*paged, new.stride(0), new.stride(1))
    else:
        code = 0
        cache = new = table = out  # unused without entries: the block table is a dummy then
        cache_args = (0, 0, 1, 0, 0, 0, 0)  # per_page 1: never divided by, but never zero either
    dim_p2 = max(MIN_DOT, triton.next_power_of_2(D))
    block_h = max(MIN_DOT, min(triton.next_power_of_2(H), 4096 // dim_p2))  # acc is [block_h, dim_p2]
    _attention[(R * T, triton.cdiv(H, block_h))](
        q, window, visible, sinks, cache, new, table, positions, indices, out,
        T, window.shape[1], K, *cache_args, D ** -0.5,
        H=H, BLOCK_H=block_h, DIM=D, DIM_P2=dim_p2, RATIO=ratio, FMT=code,
        BLOCK_N=dot_tile(dim_p2), ENTRIES=entries, LISTED=listed)
    return out
