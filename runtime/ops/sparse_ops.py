"""The op set's context-proportional ops: the indexer's choice and sparse attention.

A compressed layer's entries are addressed by absolute entry id `j` (the group of
positions `j * ratio .. (j + 1) * ratio - 1`). For a pass starting at `positions[r]`,
ids below `committed = positions[r] // ratio` are stored in the row's pages of a paged
cache [pages, page_bytes]: entry j in page `block_table[r, j // entries_per_page]`, at
record `j % entries_per_page` (entries per page = page_bytes // record bytes). The pass
creates the others itself, entry `j` at pass row `t = (j + 1) * ratio - 1 - positions[r]`
(the row whose position closes the group), and a query at position `p` may see every id
below `(p + 1) // ratio`. Every op here reads only those live entries — what the lengths
(positions) say, never the cache's capacity — and returns static shapes, so a CUDA
graph captures them and their cost follows the request rather than `max_seq_len`.

Index lists are int32, ascending, `-1`-padded at the end. The references below run on
any device (CPU in the suite); `cuda_kernels` registers Triton kernels for CUDA tensors.
"""

from __future__ import annotations

from typing import Optional

import torch

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.ops.define import fake_for, reference_op
from b12x_toolchain.runtime.ops.fixed_order import dot_last, linear_rows, softmax_last, weighted_rows

NEG_INF = float("-inf")


def closing_ids(positions: torch.Tensor, width: int, ratio: int) -> torch.Tensor:
    """[R, width] id of the entry whose group closes at each pass row, -1 where none does."""
    pos = positions.long()[:, None] + torch.arange(width, device=positions.device)
    return torch.where((pos + 1) % ratio == 0, pos // ratio, -1)


def visible_below(positions: torch.Tensor, width: int, ratio: int) -> torch.Tensor:
    """[R, width] how many entries (ids below this) the query at each pass row may see."""
    return (positions.long()[:, None] + torch.arange(width, device=positions.device) + 1) // ratio


def page_view(cache: torch.Tensor, record_bytes: int) -> torch.Tensor:
    """A paged cache [pages, page_bytes] as [pages, entries_per_page, record_bytes]."""
    return cache.view(cache.shape[0], cache.shape[1] // record_bytes, record_bytes)


def entry_rows(cache, new, block_table, positions, ids, ratio: int, dim: int, fmt: str) -> torch.Tensor:
    """Decoded entries [*ids.shape, dim] for ids [R, ...]; zeros where an id is -1.

    Stored ids are read from the paged cache, this pass's from `new` [R, T, dim] (already as
    a later read returns them). Static shapes and no host sync: every listed id's record is
    gathered and decoded (one that is not stored reads some record of the pages, unused),
    then each id takes its stored record, its entry of `new` or zero.
    """
    R = ids.shape[0]
    flat = ids.reshape(R, -1).long()
    committed = positions.long()[:, None] // ratio
    stored, fresh = (flat >= 0) & (flat < committed), flat >= committed
    codec = get_format(fmt)
    pages = page_view(cache, codec.row_bytes(dim))
    per_page = pages.shape[1]
    safe = torch.where(stored, flat, 0)
    column = (safe // per_page).clamp(max=block_table.shape[1] - 1)
    page = block_table.long().gather(1, column).clamp(min=0)
    out = torch.where(stored[..., None], codec.decode(pages[page, safe % per_page], dim), 0.0)
    if new is not None:
        pass_row = ((flat + 1) * ratio - 1 - positions.long()[:, None]).clamp(0, new.shape[1] - 1)
        recent = new.float().gather(1, pass_row[..., None].expand(-1, -1, dim))
        out = torch.where(fresh[..., None], recent, out)
    return out.view(*ids.shape, dim)


def _row_scores(q, head_weights, index_cache, new_keys, block_table, positions, r: int, ratio: int, fmt: str):
    """(ids [n], score [T, n]) over row r's live entries; -inf where a query may not see one.

    Row r's live ids are 0 .. n-1: the `committed` stored ones, then one per pass row that
    closes a group (rows first, first + ratio, ...), which are the next ids in order.
    """
    T, dim = q.shape[1], q.shape[-1]
    start = int(positions[r])
    committed = start // ratio
    first = (ratio - 1 - start) % ratio  # the first pass row whose position closes a group
    codec = get_format(fmt)
    pages = page_view(index_cache, codec.row_bytes(dim))
    used = -(-committed // pages.shape[1])
    records = pages[block_table[r, :used].long()].flatten(0, 1)[:committed]
    keys = torch.cat([codec.decode(records, dim), new_keys[r, first::ratio].float()], dim=0)
    ids = torch.arange(keys.shape[0], device=keys.device)
    # Same order of operations as the dense indexer: ReLU per head, scale, weight, sum, each
    # product and the sum over heads rounded alike whatever the entries and queries
    # (fixed_order.py).
    per_head = torch.relu(linear_rows(q[r], keys)) * dim ** -0.5  # [T, H, n]
    score = (per_head * head_weights[r][..., None]).transpose(1, 2).sum(dim=-1)
    below = torch.arange(start + 1, start + T + 1, device=keys.device) // ratio  # ids each query may see
    return ids, score.masked_fill(ids[None, :] >= below[:, None], NEG_INF)


def _top_ids(score: torch.Tensor, ids: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """out[t] = the ids of the k best finite scores, ascending, -1 padded.

    Ties go to the earlier entry (ids are ascending along the last axis): everything above
    the k-th best score is taken, then the earliest entries equal to it until k are
    chosen, so the choice is a property of the positions, not of how many entries a pass
    holds or of how a top-k kernel orders equal values. A partial top-k finds the k-th
    score; nothing sorts all n scores.
    """
    out.fill_(-1)
    take = min(k, score.shape[-1])
    if take == 0:
        return
    kth = torch.topk(score, take, dim=-1).values[:, -1:]
    above = score > kth
    tied = (score == kth) & (kth > NEG_INF)
    room = take - above.sum(dim=-1, keepdim=True)
    chosen = above | (tied & (tied.cumsum(dim=-1) <= room))
    t, j = chosen.nonzero(as_tuple=True)
    out[t, (chosen.cumsum(dim=-1) - 1)[t, j]] = ids[j].to(out.dtype)


@reference_op()
def indexer_topk(
    q: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor, new_keys: torch.Tensor,
    block_table: torch.Tensor, positions: torch.Tensor, candidates: Optional[torch.Tensor], ratio: int,
    block_size: int, topk: int, fmt: str,
) -> torch.Tensor:
    """The lightning indexer's top-k: int32 [R, T, topk] entry ids.

    q [R, T, H, D] index queries (RoPE applied), head_weights [R, T, H], index_cache the
    source layer's paged index keys [pages, page_bytes] with each row's block_table
    [R, pages_per_slot], new_keys [R, T, D] this pass's. Score of entry j:
    sum_h relu(q_h . k_j) / sqrt(D) * w_h over the entries the query may see; where
    `candidates` [R, T, C] (block ids, -1 padded) is given, only entries whose block
    `j // block_size` is among them.
    """
    R, T = q.shape[:2]
    out = torch.empty(R, T, topk, dtype=torch.int32, device=q.device)
    for r in range(R):
        ids, score = _row_scores(q, head_weights, index_cache, new_keys, block_table, positions, r, ratio, fmt)
        if candidates is not None:
            block = (ids // block_size)[None, :, None]
            allowed = (block == candidates[r].long()[:, None, :]).any(dim=-1)
            score = score.masked_fill(~allowed, NEG_INF)
        _top_ids(score, ids, topk, out[r])
    return out


@reference_op()
def candidate_blocks(
    q: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor, new_keys: torch.Tensor,
    block_table: torch.Tensor, positions: torch.Tensor, ratio: int, block_size: int, blocks: int, fmt: str,
) -> torch.Tensor:
    """Hierarchical candidates: int32 [R, T, blocks + 1] block ids.

    The `blocks` blocks of `block_size` entries with the best maximum score (ascending,
    -1 padded, ties to the earlier block), then always the block of the newest entry the
    query may see (block 0 when it sees none).
    """
    R, T = q.shape[:2]
    out = torch.empty(R, T, blocks + 1, dtype=torch.int32, device=q.device)
    newest = (visible_below(positions, T, ratio) - 1).clamp(min=0) // block_size
    for r in range(R):
        ids, score = _row_scores(q, head_weights, index_cache, new_keys, block_table, positions, r, ratio, fmt)
        block = ids // block_size
        count = int(block.max()) + 1 if block.numel() else 0
        best = torch.full((T, count), NEG_INF, device=q.device).scatter_reduce(
            -1, block[None, :].expand(T, -1), score, "amax")
        _top_ids(best, torch.arange(count, device=q.device), blocks, out[r, :, :blocks])
        out[r, :, blocks] = newest[r].to(torch.int32)
    return out


def _products(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [R, T, H, D] . keys [R, S, D] -> [R, T, H, S], each row's products through one kernel."""
    return torch.stack([linear_rows(q[r], keys[r]) for r in range(q.shape[0])])


@reference_op()
def sparse_attention(
    q: torch.Tensor, window: torch.Tensor, window_visible: torch.Tensor, sinks: torch.Tensor,
    entry_cache: Optional[torch.Tensor], new_entries: Optional[torch.Tensor], block_table: torch.Tensor,
    positions: torch.Tensor, indices: Optional[torch.Tensor], ratio: int, fmt: str,
) -> torch.Tensor:
    """Latent MQA (K = V) with a sink: q [R, T, H, D] -> [R, T, H, D] fp32.

    One softmax over the window rows [R, S, D] each query may see (window_visible
    [R, T, S]), the compressed entries it attends to, and the sink (one more logit per
    head that takes probability mass and returns nothing). Entries: none without an
    entry cache; the listed ids where `indices` [R, T, K] is given; otherwise every
    entry the query may see (layers without an indexer), by length.
    """
    R, T, H, D = q.shape
    scale = D ** -0.5
    # Zero window rows no query may see: stale or poisoned bytes must not reach 0 * NaN.
    keys = window.masked_fill(~window_visible.any(dim=1)[..., None], 0.0)
    S = keys.shape[1]
    # Every reduction has an order the query fixes (fixed_order.py): the products through
    # one kernel whatever the rows and keys, then softmax and the weighted sum over the keys
    # in position order, one term after another, the window's then the entries'. A key the
    # query does not see adds an exact zero, so a query's result is the same in every pass,
    # whatever keys the pass holds besides.
    window_scores = _products(q, keys) * scale  # [R, T, H, S]
    parts = [window_scores.masked_fill(~window_visible[:, :, None, :], NEG_INF)]
    entries = None
    if entry_cache is not None:
        if indices is not None:
            entries = entry_rows(entry_cache, new_entries, block_table, positions, indices, ratio, D, fmt)
            entries = entries[:, :, None]  # [R, T, 1, K, D]: per (row, query) its own K entries
            score = dot_last(q[..., None, :], entries) * scale
            seen = (indices >= 0)[:, :, None, :]
        else:
            below = visible_below(positions, T, ratio)
            ids = torch.arange(int(below.max()), device=q.device).expand(R, -1)
            ids = torch.where(ids < below[:, -1:], ids, -1)
            entries = entry_rows(entry_cache, new_entries, block_table, positions, ids, ratio, D, fmt)  # [R,N,D]
            score = _products(q, entries) * scale
            entries = entries[:, None, None]  # [R, 1, 1, N, D]
            seen = ((ids[:, None, :] >= 0) & (ids[:, None, :] < below[..., None]))[:, :, None, :]
        parts.append(score.masked_fill(~seen, NEG_INF))
    parts.append(sinks.view(1, 1, H, 1).expand(R, T, H, 1).float())
    probs = softmax_last(torch.cat(parts, dim=-1))
    # Window row j holds position positions - (S - T) + j; entry ids are their own places.
    out = weighted_rows(probs[..., :S], keys, positions.long() - (S - T))
    if indices is not None:  # a query's own K entries, the same list in every pass
        out = out + (probs[..., S:-1, None] * entries).transpose(-1, -2).sum(dim=-1)
    elif entries is not None:
        out = out + weighted_rows(probs[..., S:-1], entries[:, 0, 0], torch.zeros_like(positions))
    return out.contiguous()  # the layout the fake implementation declares


@fake_for(indexer_topk)
def _(q, head_weights, index_cache, new_keys, block_table, positions, candidates, ratio, block_size, topk, fmt):
    return q.new_empty((q.shape[0], q.shape[1], topk), dtype=torch.int32)


@fake_for(candidate_blocks)
def _(q, head_weights, index_cache, new_keys, block_table, positions, ratio, block_size, blocks, fmt):
    return q.new_empty((q.shape[0], q.shape[1], blocks + 1), dtype=torch.int32)


@fake_for(sparse_attention)
def _(q, window, window_visible, sinks, entry_cache, new_entries, block_table, positions, indices, ratio, fmt):
    return torch.empty_like(q, dtype=torch.float32)


SPARSE_OPS = ("indexer_topk", "candidate_blocks", "sparse_attention")
