"""Triton kernels for the indexer ops: `indexer_topk` and `candidate_blocks`.

Each op is two or three launches, all sized by the inputs' static shapes, with no host
sync, so a CUDA graph captures them:

1. (`indexer_topk` with candidates only) `_allowed_blocks`: per query, a byte map of its
   candidate blocks, cleared and set only up to the query's visible block count.
2. `_scores`: one program per (row, tile of entry ids) decodes the tile's index keys once
   (`entry_tile`: the row's cache pages below the committed length, this pass's keys
   above), then for every pass token scores them as the reference does: relu per head,
   scale, weight, sum; -inf where the token may not see an entry or its block is no
   candidate. Tiles past the row's live length exit at once: the scores buffer is sized
   by the capacity a block table can address (memory, as DeepGEMM's), the work by the
   lengths.
3. `_select`: one program per query picks the k best of its live scores (or, with
   GROUP > 1, of the per-block maxima) by an 8-bit radix select on the float bits (one
   histogram pass per digit, the first also counting the candidates; one pass when no
   more than k are live), then a compaction pass writes the chosen ids ascending and
   pads with -1.

The selection is the reference's exactly: the reference takes the first k of a stable
descending sort over ascending ids, so among equal scores the smaller id wins; only
scores above -inf are emitted; NaN sorts above everything (it takes a place and emits
nothing); -0.0 ties with 0.0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from b12x_toolchain.runtime.ops.triton_rows import format_code
from b12x_toolchain.runtime.ops.triton_sparse import MIN_DOT, dot_tile, entry_tile, paged_args

KEY_NONE = tl.constexpr(-2**31)  # -inf, or no entry: never chosen
KEY_NAN = tl.constexpr(2**31 - 1)  # above +inf, as torch's sort puts NaN first
SELECT_ELEMENTS = 4096  # scores per select tile


@triton.jit
def _allowed_blocks(candidates, allowed, positions, T, C, NB_CAP,
                    RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    """allowed[r, t, b] = 1 iff block b is among candidates[r, t], for b below t's block count."""
    r = tl.program_id(0)
    rt = r * T + tl.program_id(1)
    below = (tl.load(positions + r).to(tl.int32) + tl.program_id(1) + 1) // RATIO
    blocks = tl.minimum((below + BLOCK_SIZE - 1) // BLOCK_SIZE, NB_CAP)  # never past the buffer
    base = allowed + rt.to(tl.int64) * NB_CAP
    for start in range(0, blocks, TILE):
        b = start + tl.arange(0, TILE)
        tl.store(base + b, tl.zeros((TILE,), tl.int8), mask=b < blocks)
    tl.debug_barrier()  # the clearing stores land before any setting store of this program
    for start in range(0, C, TILE):
        c = start + tl.arange(0, TILE)
        block = tl.load(candidates + rt.to(tl.int64) * C + c, mask=c < C, other=-1).to(tl.int32)
        tl.store(base + block, tl.full((TILE,), 1, tl.int8), mask=(block >= 0) & (block < blocks))


@triton.jit
def _scores(q, weights, cache, new, block_table, positions, allowed, scores,
            T, NCAP, NB_CAP, c_p, c_e, per_page, t_r, cap, n_r, n_t, scale,
            H: tl.constexpr, H_P2: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr,
            RATIO: tl.constexpr, BLOCK_SIZE: tl.constexpr, FMT: tl.constexpr,
            BLOCK_N: tl.constexpr, CANDIDATES: tl.constexpr):
    """scores[r, t, j] for the tile's ids j below row r's live length."""
    r = tl.program_id(0)
    pos = tl.load(positions + r).to(tl.int32)
    live = tl.minimum((pos + T) // RATIO, NCAP)  # committed ids plus the groups this pass closes
    ids = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if tl.program_id(1) * BLOCK_N < live:
        ok = ids < live
        table = block_table + r.to(tl.int64) * t_r  # this row's pages
        keys = entry_tile(cache, c_p, c_e, per_page, table, cap, new, n_r, n_t, r, ids, ok, pos // RATIO,
                          pos, T, RATIO, FMT, DIM, DIM_P2, BLOCK_N)
        h = tl.arange(0, H_P2)
        d = tl.arange(0, DIM_P2)
        for t in range(T):
            rt = (r * T + t).to(tl.int64)
            qt = tl.load(q + (rt * H + h[:, None]) * DIM + d[None, :], mask=(h < H)[:, None] & (d < DIM)[None, :],
                         other=0.0)
            w = tl.load(weights + rt * H + h, mask=h < H, other=0.0)
            # The reference's order per head: relu, then scale, then weight; then the sum.
            per_head = tl.maximum(tl.dot(qt, tl.trans(keys), input_precision="ieee"), 0.0) * scale
            s = tl.sum(per_head * w[:, None], axis=0)
            seen = ids < (pos + t + 1) // RATIO
            if CANDIDATES:
                block = ids // BLOCK_SIZE
                seen = seen & (tl.load(allowed + rt * NB_CAP + block, mask=seen, other=0) != 0)
            tl.store(scores + rt * NCAP + ids, tl.where(seen, s, float("-inf")), mask=ok)


@triton.jit
def _tile_keys(row, start, n, below, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TILE: tl.constexpr):
    """(candidate numbers, keys) of candidates start .. start + TILE: the score of an entry
    (GROUP 1) or the maximum over a block of GROUP entries; KEY_NONE past n.

    A key is an int32 whose signed order is the scores' order: -0.0 ties with 0.0, NaN is
    KEY_NAN (on top), -inf is KEY_NONE.
    """
    idx = start + tl.arange(0, TILE)
    if GROUP == 1:
        s = tl.load(row + idx, mask=idx < n, other=float("-inf"))
    else:
        g = tl.arange(0, GROUP_P2)[None, :]
        j = idx[:, None] * GROUP + g
        s = tl.max(tl.load(row + j, mask=(idx[:, None] < n) & (g < GROUP) & (j < below), other=float("-inf")), axis=1)
    bits = tl.where(s == 0.0, 0, s.to(tl.int32, bitcast=True))
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude, smaller key
    key = tl.where(s != s, KEY_NAN, key)
    return idx, tl.where(s == float("-inf"), KEY_NONE, key)


@triton.jit
def _digit_histogram(row, n, below, prefix, shift, FIRST: tl.constexpr, GROUP: tl.constexpr,
                     GROUP_P2: tl.constexpr, TILE: tl.constexpr):
    """Histogram of the 8-bit digit at `shift` of the keys (sign bit flipped: unsigned
    order) whose higher digits are `prefix`'s; every candidate's for the FIRST digit."""
    hist = tl.zeros((256,), tl.int32)
    for start in range(0, n, TILE):
        idx, key = _tile_keys(row, start, n, below, GROUP, GROUP_P2, TILE)
        ukey = key ^ KEY_NONE
        match = key != KEY_NONE
        if not FIRST:
            match = match & (((ukey ^ prefix) >> (shift + 8)) == 0)
        hist += tl.histogram((ukey >> shift) & 255, 256, mask=match)
    return hist


@triton.jit
def _select(scores, out, positions, T, NCAP, OUT_STRIDE, K,
            RATIO: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TILE: tl.constexpr,
            NEWEST: tl.constexpr):
    """out[r, t, :K] = the K best candidates of query (r, t), ascending, -1 padded; with
    NEWEST, out[r, t, K] = the block of the newest entry it sees (0 when none)."""
    r = tl.program_id(0)
    rt = (r * T + tl.program_id(1)).to(tl.int64)
    below = tl.minimum((tl.load(positions + r).to(tl.int32) + tl.program_id(1) + 1) // RATIO, NCAP)
    n = (below + GROUP - 1) // GROUP  # only this query's live candidates are read
    row = scores + rt * NCAP
    dst = out + rt * OUT_STRIDE
    # Threshold: the K-th largest key, and how many keys equal to it are taken. With no
    # more than K candidates every one is taken (threshold KEY_NONE, no ties). The top
    # digit's histogram also counts the candidates.
    bins = tl.arange(0, 256)
    hist = _digit_histogram(row, n, below, 0, 24, True, GROUP, GROUP_P2, TILE)
    total = tl.sum(hist)
    threshold = tl.full((), KEY_NONE, tl.int32)
    need = total * 0
    if total > K:
        prefix = total * 0  # the digits chosen so far, in unsigned-order bits
        need += K
        for p in tl.static_range(4):
            shift = 24 - 8 * p  # a constant: p is unrolled
            if p > 0:
                hist = _digit_histogram(row, n, below, prefix, shift, False, GROUP, GROUP_P2, TILE)
            above = tl.sum(hist) - tl.cumsum(hist, 0)  # matching keys in higher bins
            digit = tl.max(tl.where(above + hist >= need, bins, 0))
            need -= tl.sum(tl.where(bins == digit, above, 0))
            prefix = prefix | (digit << shift)
        threshold = prefix ^ KEY_NONE
    # Compaction in ascending candidate order: everything above the threshold, and the
    # first `need` equal to it (ties to the smaller id).
    written = total * 0
    ties = total * 0
    for start in range(0, n, TILE):
        idx, key = _tile_keys(row, start, n, below, GROUP, GROUP_P2, TILE)
        tie = (key == threshold).to(tl.int32)
        rank = ties + tl.cumsum(tie, 0) - 1
        keep = ((key > threshold) | ((tie != 0) & (rank < need))) & (key != KEY_NAN) & (idx < n)
        slot = written + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(dst + slot, idx, mask=keep)
        written += tl.sum(keep.to(tl.int32))
        ties += tl.sum(tie)
    for start in range(0, K, TILE):
        o = start + tl.arange(0, TILE)
        tl.store(dst + o, tl.full((TILE,), -1, tl.int32), mask=(o >= written) & (o < K))
    if NEWEST:
        tl.store(dst + K, tl.maximum(below - 1, 0) // GROUP)


def _score_all(q, head_weights, index_cache, new_keys, block_table, positions, candidates, ratio, block_size, fmt):
    """The scores scratch buffer [R, T, capacity + T] (only live ids written) and its width."""
    R, T, H, D = q.shape
    code = format_code(fmt)
    cache, table, paged = paged_args(index_cache, block_table, code, D, fmt)
    cap = paged[-1]  # the ids a row's block table can address
    ncap = cap + T  # committed ids (at most the capacity) plus at most T closed in the pass
    scores = torch.empty(R, T, ncap, dtype=torch.float32, device=q.device)
    q = q.to(torch.float32).contiguous()
    weights = head_weights.to(torch.float32).contiguous()
    new = new_keys.to(torch.float32)
    new = new if new.stride(-1) == 1 else new.contiguous()
    nb_cap = triton.cdiv(ncap, block_size)
    allowed = scores  # unused without candidates
    if candidates is not None:
        allowed = torch.empty(R, T, nb_cap, dtype=torch.int8, device=q.device)
        cands = candidates.contiguous()
        _allowed_blocks[(R, T)](cands, allowed, positions, T, cands.shape[-1], nb_cap,
                                RATIO=ratio, BLOCK_SIZE=block_size, TILE=1024)
    dim_p2 = max(MIN_DOT, triton.next_power_of_2(D))
    block_n = dot_tile(dim_p2)
    _scores[(R, triton.cdiv(ncap, block_n))](
        q, weights, cache, new, table, positions, allowed, scores,
        T, ncap, nb_cap, *paged, new.stride(0), new.stride(1), D ** -0.5,
        H=H, H_P2=max(MIN_DOT, triton.next_power_of_2(H)), DIM=D, DIM_P2=dim_p2, RATIO=ratio,
        BLOCK_SIZE=block_size, FMT=code, BLOCK_N=block_n, CANDIDATES=candidates is not None)
    return scores, ncap


def _launch_select(scores, ncap, out, positions, k, ratio, group, newest):
    R, T = out.shape[:2]
    group_p2 = triton.next_power_of_2(group)
    # No tile wider than the candidates the buffer can hold.
    tile = max(16, min(SELECT_ELEMENTS // group_p2, triton.next_power_of_2(triton.cdiv(ncap, group))))
    _select[(R, T)](scores, out, positions, T, ncap, out.shape[-1], k, RATIO=ratio, GROUP=group,
                    GROUP_P2=group_p2, TILE=tile, NEWEST=newest)


def indexer_topk(q, head_weights, index_cache, new_keys, block_table, positions, candidates, ratio: int,
                 block_size: int, topk: int, fmt: str) -> torch.Tensor:
    R, T = q.shape[:2]
    out = torch.empty(R, T, topk, dtype=torch.int32, device=q.device)
    if out.numel() == 0:
        return out
    scores, ncap = _score_all(q, head_weights, index_cache, new_keys, block_table, positions, candidates,
                              ratio, block_size, fmt)
    _launch_select(scores, ncap, out, positions, topk, ratio, 1, newest=False)
    return out


def candidate_blocks(q, head_weights, index_cache, new_keys, block_table, positions, ratio: int, block_size: int,
                     blocks: int, fmt: str) -> torch.Tensor:
    R, T = q.shape[:2]
    out = torch.empty(R, T, blocks + 1, dtype=torch.int32, device=q.device)
    if out.numel() == 0:
        return out
    scores, ncap = _score_all(q, head_weights, index_cache, new_keys, block_table, positions, None,
                              ratio, block_size, fmt)
    _launch_select(scores, ncap, out, positions, blocks, ratio, block_size, newest=True)
    return out
