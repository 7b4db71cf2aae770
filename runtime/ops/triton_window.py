"""Triton kernels for the window staging ops: snapshot, append, fused snapshot+append, commit.

One kernel serves all three staging ops, with the snapshot tiles and the append tiles
switched on or off at compile time: `window_snapshot` and `cache_append` are one launch
each and `window_snapshot_append` is exactly one launch doing both, so a captured graph of
the fused pass has one kernel node fewer per fused window layer, and the two paths write
staging with the same code. Snapshot tiles copy ring rows as words (the widest integer
unit the row size and alignment allow); append tiles encode fp32 rows with the bit-exact
codecs of `triton_codecs`.

A request's history is HISTORY consecutive ring rows (wrapping at the ring's end) and lands in
HISTORY consecutive staging rows, so the snapshot copies it as one flat run of words in
tiles of COPY_WORDS, every lane busy: tiles of whole rows would pad each row to a power of
two (a 528-byte record is 132 words, 256 lanes) and leave half the lanes idle.

The fused kernel encodes the block formats (V4.1 records, OCP MX); for the bit formats (bf16, fp32) the
fused op runs the snapshot kernel and the row kernel back to back, with the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.ops import triton_rows
from b12x_toolchain.runtime.ops.triton_codecs import (
    DSV41_MXFP4,
    DSV41_MXFP8,
    DSV41_NVFP4,
    OCP_MXFP4,
    OCP_MXFP8,
    store_rows,
)
from b12x_toolchain.runtime.ops.triton_rows import CODES, tokens_per_tile, word_view

# Measured on an H200 at the full model's shapes (4096 requests, 128 history rows of 528
# bytes, 8 appended): the snapshot alone moves 98% of a device copy's bytes per second in
# 2048-word tiles (the row tiles before, 93%); the fused op, whose append tiles encode fp32
# rows, is fastest with 4096-word tiles and 8 warps (66% of the copy; 61% at 1024 or 2048
# words and 4 warps, 61% with the row tiles).
COPY_WORDS = 4096  # words per snapshot tile
NUM_WARPS = 8
FUSABLE = {"dsv41_mxfp8": DSV41_MXFP8, "dsv41_nvfp4": DSV41_NVFP4, "dsv41_mxfp4": DSV41_MXFP4,
           "ocp_mxfp8": OCP_MXFP8, "ocp_mxfp4": OCP_MXFP4}


@triton.jit
def _window(ring, stage_w, stage_b, kv, row_ids, positions,
            ring_s, stage_rw, stage_rb, kv_r, kv_t, COPY_TILES,
            HISTORY: tl.constexpr, CAP: tl.constexpr, WPR: tl.constexpr,
            ROW_BYTES: tl.constexpr, WIDTH: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr,
            FMT: tl.constexpr, COPY_W: tl.constexpr, TOK: tl.constexpr,
            SNAPSHOT: tl.constexpr, APPEND: tl.constexpr):
    """Program (r, tile): tiles below COPY_TILES copy history words, the rest encode kv rows.

    staging[r, j] = ring[row_ids[r], (positions[r] - HISTORY + j) mod CAP] for j < HISTORY;
    staging[r, HISTORY + t] = encode(kv[r, t]) for t < WIDTH.
    """
    r = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    if SNAPSHOT:
        if tile < COPY_TILES:
            f = tile * COPY_W + tl.arange(0, COPY_W)  # word f of the history
            at = ring + tl.load(row_ids + r).to(tl.int64) * ring_s
            first = (tl.load(positions + r).to(tl.int32) - HISTORY) % CAP  # the history's first ring row
            start = tl.where(first < 0, first + CAP, first) * WPR  # either % semantics
            ok = f < HISTORY * WPR
            if HISTORY <= CAP:
                # At most one wrap: a load before the ring's end and one from its start, each
                # over consecutive words, so Triton can move them as 16-byte vectors.
                head = start + f < CAP * WPR
                words = tl.load(at + start + f, mask=ok & head)
                words = tl.where(head, words, tl.load(at + (start - CAP * WPR) + f, mask=ok & ~head))
            else:
                words = tl.load(at + (start + f) % (CAP * WPR), mask=ok)
            tl.store(stage_w + r * stage_rw + f, words, mask=ok)
    if APPEND:
        if tile >= COPY_TILES:
            t = (tile - COPY_TILES) * TOK + tl.arange(0, TOK)
            ok = (t < WIDTH)[:, None]
            d = tl.arange(0, DIM_P2)[None, :]
            x = tl.load(kv + r * kv_r + t[:, None].to(tl.int64) * kv_t + d, mask=ok & (d < DIM), other=0.0)
            dst = stage_b + r * stage_rb + (HISTORY + t[:, None]).to(tl.int64) * ROW_BYTES
            store_rows(dst, x, ok, FMT, DIM, DIM_P2, TOK)


def _launch(ring, staging, kv, row_ids, positions, history: int, fmt: str | None,
            snapshot: bool, append: bool) -> None:
    view = staging.view(staging.shape[0], -1, staging.shape[-1])  # layout.token_view
    rows, row_bytes = view.shape[0], view.shape[-1]
    if rows == 0:
        return
    cap = ring.shape[1] if snapshot else 1
    if snapshot:
        ring_w, stage_w = word_view(ring, view)
        ring_s = ring_w.stride(0)
    else:
        ring_w, stage_w, ring_s = view, view, 0
    wpr = stage_w.shape[-1]
    copy_tiles = triton.cdiv(history * wpr, COPY_WORDS) if snapshot else 0
    width = kv.shape[1] if append else 0
    dim = kv.shape[-1] if append else 32
    if append:
        if get_format(fmt).row_bytes(dim) != row_bytes:
            raise ValueError(f"{fmt}: {dim}-dim rows are {get_format(fmt).row_bytes(dim)} bytes; staging rows are {row_bytes}")
        kv = kv.to(torch.float32)
        kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    else:
        kv = view
    dim_p2 = triton.next_power_of_2(dim)
    tok = tokens_per_tile(max(width, 1), dim_p2)
    append_tiles = triton.cdiv(width, tok) if append else 0
    ids = row_ids if snapshot else view
    pos = positions if snapshot else view
    _window[(rows, copy_tiles + append_tiles)](
        ring_w, stage_w, view, kv, ids, pos,
        ring_s, stage_w.stride(0), view.stride(0), kv.stride(0) if append else 0, kv.stride(1) if append else 0,
        copy_tiles, HISTORY=history, CAP=cap, WPR=wpr, ROW_BYTES=row_bytes,
        WIDTH=width, DIM=dim, DIM_P2=dim_p2, FMT=FUSABLE.get(fmt, OCP_MXFP8), COPY_W=COPY_WORDS, TOK=tok,
        SNAPSHOT=snapshot, APPEND=append, num_warps=NUM_WARPS)


def window_snapshot(ring, staging, row_ids, positions, history: int, layout: str, page_size: int) -> None:
    _launch(ring, staging, None, row_ids, positions, history, None, snapshot=True, append=False)


def cache_append(staging, kv, history: int, layout: str, page_size: int, fmt: str) -> None:
    if fmt in FUSABLE:
        _launch(None, staging, kv, None, None, history, fmt, snapshot=False, append=True)
    else:
        view = staging.view(staging.shape[0], -1, staging.shape[-1])
        triton_rows.stage_rows(view[:, history:], kv, fmt)


def window_snapshot_append(ring, staging, kv, row_ids, positions, history: int, layout: str,
                           page_size: int, fmt: str) -> None:
    if fmt in FUSABLE:
        _launch(ring, staging, kv, row_ids, positions, history, fmt, snapshot=True, append=True)
    else:
        window_snapshot(ring, staging, row_ids, positions, history, layout, page_size)
        cache_append(staging, kv, history, layout, page_size, fmt)


# ---------------------------------------------------------------- commit


@triton.jit
def _commit(ring, stage, row_ids, positions, accept_len, ring_s, stage_r,
            HISTORY: tl.constexpr, CAP: tl.constexpr, WIDTH: tl.constexpr, WIDTH_P2: tl.constexpr,
            WPR: tl.constexpr, WPR_P2: tl.constexpr):
    """ring[row_ids[r], (positions[r] + t) mod CAP] = staging[r, HISTORY + t] for t < accept_len[r]."""
    r = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, WIDTH_P2)
    ok = (t < WIDTH) & (t < tl.load(accept_len + r).to(tl.int32))
    slot = tl.load(row_ids + r).to(tl.int64)
    dst_tok = (tl.load(positions + r).to(tl.int64) + t) % CAP
    dst_tok = tl.where(dst_tok < 0, dst_tok + CAP, dst_tok)
    w = tl.arange(0, WPR_P2)[None, :]
    m = ok[:, None] & (w < WPR)
    words = tl.load(stage + r * stage_r + (HISTORY + t[:, None]).to(tl.int64) * WPR + w, mask=m)
    tl.store(ring + slot * ring_s + dst_tok[:, None] * WPR + w, words, mask=m)


def window_commit(ring, staging, row_ids, positions, accept_len, history: int, width: int) -> None:
    view = staging.view(staging.shape[0], -1, staging.shape[-1])
    if view.shape[0] == 0 or width == 0:
        return
    ring_w, stage_w = word_view(ring, view)
    wpr = stage_w.shape[-1]
    _commit[(view.shape[0],)](
        ring_w, stage_w, row_ids, positions, accept_len, ring_w.stride(0), stage_w.stride(0),
        HISTORY=history, CAP=ring.shape[1], WIDTH=width, WIDTH_P2=triton.next_power_of_2(width),
        WPR=wpr, WPR_P2=triton.next_power_of_2(wpr))


__all__ = ["window_snapshot", "cache_append", "window_snapshot_append", "window_commit", "CODES"]
