"""Inputs for byte-equality checks of the cache writers: random rows plus the edge vectors.

Also the sparse ops' cases and the FP8 linears' (with the float32 bound their kernels
are held to). Shared by the kernel tests (CPU, Triton interpreter) and `gpu_check.py`
(GPU), so both compare the same cases. Nothing here is a benchmark; it only builds tensors.
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.formats.layout import staging_shape

HISTORY = 128
# Zeros of both signs, the E4M3 limit and values around it (464 ties, 480 and above would
# be NaN without saturation), huge and infinite values, float32 subnormals, E4M3
# subnormal steps and a tie between them, and plain values at E2M1 midpoints.
EDGE_VALUES = (0.0, -0.0, 448.0, -448.0, 464.0, 479.9, 480.0, -1e30, 1e30, float("inf"), float("-inf"),
               1e-40, -1e-42, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 1.0, 0.75, -1.25, 5.0, 2.5, 1.9 * 2.0**100)


def edge_rows(dim: int) -> torch.Tensor:
    """Rows that each stress one rule of the formats: [10, dim] float32."""
    rows = torch.randn(10, dim, generator=torch.Generator().manual_seed(dim))
    rows[0, : len(EDGE_VALUES)] = torch.tensor(EDGE_VALUES)
    rows[1] = 0.0
    rows[2] = -0.0
    rows[3, dim // 2] = float("nan")  # one NaN poisons its block only
    rows[4, 1] = -float("nan")  # NaN of either sign writes the same canonical bytes
    rows[5] = torch.linspace(-1e-38, 1e-38, dim) * 1e-3  # float32 subnormals
    rows[6] = rows[6].abs() * 2.0**120  # huge but finite
    rows[7] = 1.9 * 2.0**5  # mantissa above 1.75 at the block maximum: saturates to 448
    rows[8] = torch.where(torch.arange(dim) % 2 == 0, 1e-30, 2.0**20)  # tiny beside huge
    # Block maxima one ulp above 7 = 448 * 2^-6: the V4.1 window scale stays 2^-6 (float32
    # log2 of amax / 448 rounds to -6) and the maximum saturates.
    rows[9] = rows[9].clamp(-1, 1)
    rows[9, ::32] = 7.0 + 2.0**-21
    return rows


def kv_rows(gen: torch.Generator, rows: int, width: int, dim: int) -> torch.Tensor:
    """[rows, width, dim] float32: random at mixed magnitudes with the edge rows spliced in."""
    kv = torch.randn(rows, width, dim, generator=gen) * torch.logspace(-3, 3, width)[None, :, None]
    edges = edge_rows(dim)
    flat = kv.view(-1, dim)
    for i in range(min(len(edges), flat.shape[0])):
        flat[(i * 5) % flat.shape[0]] = edges[i]
    return kv


def window_case(gen: torch.Generator, rows: int, width: int, dim: int, page_size: int, fmt: str = "dsv41_mxfp8",
                slots: int = 5, device="cpu") -> dict:
    """Arguments of the window ops: random ring bytes, poisoned staging, kv, rows and positions.

    Positions cover a ring that has wrapped (200), one just past the window (129) and a
    short request whose history reaches before position 0 (5).
    """
    row_bytes = get_format(fmt).row_bytes(dim)
    ring = torch.randint(0, 256, (slots, HISTORY, row_bytes), dtype=torch.uint8, generator=gen)
    shape = staging_shape(rows, HISTORY + width, row_bytes, "NHD", page_size)
    case = {
        "ring": ring,
        "staging": torch.full(shape, 0xFF, dtype=torch.uint8),  # poisoned: every byte must be written
        "kv": kv_rows(gen, rows, width, dim),
        "row_ids": torch.tensor([3, 0, 4, 1][:rows], dtype=torch.int32),
        "positions": torch.tensor([200, 5, 129, 64][:rows], dtype=torch.int32),
        "accept_len": torch.tensor([width, 0, 3, 1][:rows], dtype=torch.int32),
    }
    return {k: v.to(device) for k, v in case.items()}


# ---------------------------------------------------------------- sparse ops (sparse_ops.py)

# (ratio, positions, width, entry format, index format, index dim): every cache format for
# entries and index keys, index dims 64 and 128, widths 8 and 7, rows 1 and 3; positions
# where nothing is committed yet (0, and below the ratio), where the pass closes groups
# (every row at ratio 1; 3 -> 4 and 255 -> 256 at its first row) and where it closes none
# (130 at ratio 128).
SPARSE_CASES = [
    (1, [0, 5, 30], 8, "dsv41_nvfp4", "dsv41_mxfp4", 128),
    (2, [9], 7, "dsv41_mxfp8", "dsv41_nvfp4", 64),
    (4, [3, 0, 64], 8, "ocp_mxfp4", "fp32", 128),
    (128, [0, 130, 255], 7, "fp32", "dsv41_mxfp8", 64),
]
SPARSE_BLOCK_SIZE, SPARSE_BLOCKS = 4, 3  # candidate blocks of the small cases
PAGE_ENTRIES = 4  # entries per cache page in the small cases: every row spans several pages
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def sparse_case_id(spec) -> str:
    ratio, positions, width, fmt, index_fmt, index_dim = spec
    return f"ratio{ratio}-rows{len(positions)}-w{width}-{fmt}-{index_fmt}{index_dim}"


def small_sparse_case(spec, seed: int = 0, **kw) -> dict:
    """`sparse_case` of one SPARSE_CASES entry (or one like it)."""
    ratio, positions, width, fmt, index_fmt, index_dim = spec
    return sparse_case(torch.Generator().manual_seed(seed + ratio), positions, width, ratio, fmt=fmt,
                       index_fmt=index_fmt, index_dim=index_dim, **kw)


def _grid_rows(gen: torch.Generator, shape: tuple, dim: int) -> torch.Tensor:
    """Values on the E2M1 grid, each 16-block holding a 6: every format stores them exactly."""
    grid = torch.tensor(E2M1_GRID)
    x = grid[torch.randint(0, len(grid), (*shape, dim), generator=gen)]
    x = x * torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0)
    x[..., ::16] = 6.0  # a block maximum of 6: scale 1 in nvfp4 and mxfp4, exact in mxfp8
    return x


def page_table(gen: torch.Generator, mapped: list[int], width: int, spare: int = 3) -> torch.Tensor:
    """A block table [R, width] into a pool of sum(mapped) + spare pages: row r's first
    mapped[r] columns are distinct pages in random order, -1 after; the spare pages no row owns."""
    order = torch.randperm(sum(mapped) + spare, generator=gen).to(torch.int32)
    table = torch.full((len(mapped), width), -1, dtype=torch.int32)
    start = 0
    for r, count in enumerate(mapped):
        table[r, :count] = order[start : start + count]
        start += count
    return table


def to_pages(records: torch.Tensor, table: torch.Tensor, per_page: int, pages: int) -> torch.Tensor:
    """A paged cache [pages, per_page * record_bytes] holding row r's records [R, n, record_bytes]
    in the pages table[r] maps, entry j in page table[r, j // per_page]. Every other byte is
    0xFF (NaN in every format): pages no row owns, and records past n."""
    R, n, record_bytes = records.shape
    width = table.shape[1]
    rows = torch.full((R, width * per_page, record_bytes), 0xFF, dtype=torch.uint8)
    rows[:, : min(n, width * per_page)] = records[:, : width * per_page]
    cache = torch.full((pages, per_page * record_bytes), 0xFF, dtype=torch.uint8)
    mapped = table >= 0
    cache[table[mapped].long()] = rows.view(R, width, -1)[mapped]
    return cache


def page_case(case: dict, gen: torch.Generator, width: int | None = None, spare: int = 3) -> dict:
    """`case` with its entry and index records (`entry_records`, `index_records`) laid out in
    paged caches under a new random block table, shared by both caches (the same entries
    per page in each). Each row maps the pages of the entries it holds once this pass is
    written (committed plus the groups it closes), -1 after; `width` (the capacity a table
    addresses, in pages) defaults to the records' capacity."""
    per_page = case["page_entries"]
    capacity = case["entry_records"].shape[1]
    width = width or -(-capacity // per_page)
    T = case["iq"].shape[1]
    held = [(p + T) // case["ratio"] for p in case["positions"].tolist()]
    mapped = [min(-(-n // per_page), width) for n in held]
    table, pages = page_table(gen, mapped, width, spare), sum(mapped) + spare
    return dict(case, block_table=table,
                entry_cache=to_pages(case["entry_records"].cpu(), table, per_page, pages),
                index_cache=to_pages(case["index_records"].cpu(), table, per_page, pages))


def sparse_case(gen: torch.Generator, positions: list[int], width: int, ratio: int, *, fmt: str = "dsv41_nvfp4",
                index_fmt: str = "dsv41_mxfp4", index_dim: int = 64, dim: int = 64, heads: int = 4,
                index_heads: int = 4, capacity: int | None = None, page_entries: int = PAGE_ENTRIES,
                ties: bool = False, exact: bool = False, device="cpu") -> dict:
    """Arguments of `indexer_topk`, `candidate_blocks` and `sparse_attention` for these rows.

    Every row's entries live in paged caches (`page_case`: shuffled pages, `page_entries`
    per page, 0xFF in pages no row owns). Record bytes past each row's committed length
    (`positions[r] // ratio`) are 0xFF: NaN in every format, so an op that reads past the
    length, or through a wrong page, shows it. `ties`: every index score is an exact 0
    (keys opposite to the queries, ReLU'd away), so the tie rule decides all. `exact`:
    queries, weights and keys on coarse grids with `index_dim` 64, so every score is exact
    in fp32 in any summation order (the selection cannot depend on rounding), and stored
    keys in equal pairs (ids 2i, 2i + 1), so nonzero scores tie. Otherwise scores are
    random floats without exact ties, except ReLU zeros where every head's product is
    negative.
    """
    rows = len(positions)
    committed = [p // ratio for p in positions]
    capacity = capacity or max(max(committed), 1) + 16
    if exact:
        index = _grid_rows(gen, (rows, capacity), index_dim)
        index[:, 1::2] = index[:, 0::2][:, : capacity // 2]  # equal pairs: an odd k splits a tie
        iq = torch.randint(-2, 3, (rows, width, index_heads, index_dim), generator=gen) / 2.0
        weights = torch.randint(1, 9, (rows, width, index_heads), generator=gen) / 8.0
        new_keys = _grid_rows(gen, (rows, width), index_dim)
    else:
        index = torch.randn(rows, capacity, index_dim, generator=gen)
        iq = torch.randn(rows, width, index_heads, index_dim, generator=gen)
        weights = torch.rand(rows, width, index_heads, generator=gen) + 0.1
        new_keys = torch.randn(rows, width, index_dim, generator=gen)
    if ties:
        iq, index, new_keys = iq.abs(), -index.abs(), -new_keys.abs()
    index_records = get_format(index_fmt).encode(index)
    entry_records = get_format(fmt).encode(torch.randn(rows, capacity, dim, generator=gen))
    for r in range(rows):
        index_records[r, committed[r]:] = 0xFF
        entry_records[r, committed[r]:] = 0xFF
    # This pass's rows as a later read of the cache returns them.
    later = lambda x, f, d: get_format(f).decode(get_format(f).encode(x), d)  # noqa: E731
    window_rows = 6 + width
    case = {
        "q": torch.randn(rows, width, heads, dim, generator=gen),
        "iq": iq, "head_weights": weights,
        "index_records": index_records, "new_keys": later(new_keys, index_fmt, index_dim),
        "entry_records": entry_records, "new_entries": later(torch.randn(rows, width, dim, generator=gen), fmt, dim),
        "positions": torch.tensor(positions, dtype=torch.int32),
        "window": torch.randn(rows, window_rows, dim, generator=gen),
        "window_visible": torch.rand(rows, width, window_rows, generator=gen) > 0.3,
        "sinks": torch.randn(heads, generator=gen),
    }
    case.update(ratio=ratio, fmt=fmt, index_fmt=index_fmt, committed=committed, page_entries=page_entries)
    case = page_case(case, gen)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def topk_args(case: dict, candidates=None, block_size: int = 4, topk: int = 8) -> tuple:
    """`indexer_topk`'s arguments for a sparse case."""
    return (case["iq"], case["head_weights"], case["index_cache"], case["new_keys"], case["block_table"],
            case["positions"], candidates, case["ratio"], block_size, topk, case["index_fmt"])


def blocks_args(case: dict, block_size: int = 4, blocks: int = 3) -> tuple:
    """`candidate_blocks`' arguments for a sparse case."""
    return (case["iq"], case["head_weights"], case["index_cache"], case["new_keys"], case["block_table"],
            case["positions"], case["ratio"], block_size, blocks, case["index_fmt"])


def attention_args(case: dict, indices=None, entries: bool = True) -> tuple:
    """`sparse_attention`'s arguments for a sparse case (window only when not `entries`)."""
    return (case["q"], case["window"], case["window_visible"], case["sinks"],
            case["entry_cache"] if entries else None, case["new_entries"] if entries else None,
            case["block_table"], case["positions"], indices, case["ratio"], case["fmt"])


# ---------------------------------------------------------------- quantized linears (quant_ops.py)

# (rows, out, in, block, scale encoding): every block shape under both scale encodings,
# edges that are not multiples of the block, of the 128-channel activation group or of a
# K step, and a single token.
FP8_LINEAR_CASES = [
    (5, 200, 300, (128, 128), "ue8m0"),
    (17, 96, 256, (128, 128), "fp32"),
    (3, 70, 100, (32, 32), "ue8m0"),
    (1, 64, 96, (32, 32), "fp32"),
    (9, 33, 160, (1, 32), "ue8m0"),
    (2, 48, 130, (1, 32), "fp32"),
]
# The full V4.1 model's q_a projection (hidden 5120 -> q rank 1536) at verify width 8: a
# long K, where how precisely the hardware sums each step shows.
FP8_LINEAR_FULL = [(8, 1536, 5120, (32, 32), "ue8m0"), (8, 1536, 5120, (128, 128), "fp32")]


def fp8_linear_case(rows: int, n_out: int, n_in: int, block: tuple[int, int], encoding: str, seed: int = 0):
    """(x [rows, in] float32, E4M3 weight [out, in], scale) of random weights quantized in `block`s.

    x spans three decades across its channels, so activation groups get different scales.
    """
    from b12x_toolchain.runtime.formats.weight_formats import quantize_fp8_block

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=gen) * torch.logspace(-2, 1, n_in)
    weight, scale = quantize_fp8_block(torch.randn(n_out, n_in, generator=gen) * 0.05, block, encoding)
    return x, weight, scale


def accumulation_bound(xa: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise K * 2^-23 * (|xa| @ |w|.T): twice the worst-case float32 error of a dot of K terms.

    Two float32 computations of xa @ w.T that differ only in summation order (and in
    where an exact scale multiplies) are at most this far apart.
    """
    return xa.shape[-1] * 2.0**-23 * (xa.abs().double() @ w.abs().double().T).float()


# ---------------------------------------------------------------- roofline: the least each timed case must do

# What a kernel cannot avoid: the bytes it must read and write once (inputs, cache records
# it must look at, outputs) and the multiply-adds (x2) of its dots. A card's peak rates turn
# them into a floor time; measured / floor says how far from the hardware a kernel runs.
# The floors are lower bounds, on purpose optimistic: FLOPs count at tensor-core rates even
# where a kernel must sum in float32, and entries several queries of a row share count once.


def work(nbytes: float, flops: float = 0.0, dot: str = "bf16") -> dict:
    """dot: the tensor-core rate that bounds the FLOPs ("bf16", or "fp8" for an FP8 dot)."""
    return {"bytes": int(nbytes), "flops": int(flops), "dot": dot}


def fp8_linear_work(rows: int, n_out: int, n_in: int, block: tuple[int, int], encoding: str, dot: str) -> dict:
    """`fp8_block_linear`: the E4M3 weight and its block scales once, float32 x in and y out."""
    scales = -(-n_out // block[0]) * -(-n_in // block[1]) * (1 if encoding == "ue8m0" else 4)
    nbytes = n_out * n_in + scales + rows * n_in * 4 + rows * n_out * 4
    return work(nbytes, 2 * rows * n_out * n_in, "fp8" if dot == "fp8" else "bf16")


def sparse_work(name: str, committed: int, rows: int, width: int, *, dim: int, heads: int, index_dim: int,
                index_heads: int, fmt: str, index_fmt: str, topk: int, block_size: int, blocks: int) -> dict:
    """One sparse op of gpu_check's timing rows (`_sparse_calls` names) at `committed` entries a row.

    Scoring ops read every committed index key of a row (or, within candidate blocks, at
    least one query's blocks) and score it for every query and indexer head; attention reads
    the entries it attends (at least top-k of a row, or all of them) plus the window rows,
    and does two dots (scores, then values) per head.
    """
    key_bytes, entry_bytes = get_format(index_fmt).row_bytes(index_dim), get_format(fmt).row_bytes(dim)
    queries = rows * width
    if name in ("topk", "blocks", "topk in blocks"):
        keys = min(committed, blocks * block_size) if name == "topk in blocks" else committed
        outputs = queries * (topk if name != "blocks" else blocks + 1) * 4
        inputs = queries * index_heads * (index_dim + 1) * 4 + queries * index_dim * 4  # queries, weights, new keys
        return work(rows * keys * key_bytes + inputs + outputs, 2 * queries * index_heads * (keys + width) * index_dim)
    window = 6 + width  # the window rows of `sparse_case`
    entries = min(committed, topk) if name == "attention top-k" else committed
    vectors = queries * heads * dim * 4 * 2 + rows * window * dim * 4 + queries * width * dim * 4  # q, out, window, new
    return work(rows * entries * entry_bytes + vectors, 4 * queries * heads * (entries + window) * dim)


def window_writer_work(rows: int, width: int, dim: int, fmt: str = "dsv41_mxfp8") -> dict:
    """The fused window writer: reads each row's history ring and its new kv, writes staging."""
    row_bytes = get_format(fmt).row_bytes(dim)
    return work(rows * HISTORY * row_bytes + rows * width * dim * 4 + rows * (HISTORY + width) * row_bytes)
