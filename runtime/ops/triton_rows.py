"""Triton kernels for the generic row ops: stage_rows, write_rows, write_slots, gather_rows,
read_rows, window_read and round_trip (each one launch), with launchers taking the ops' arguments.

The launchers are plain Python and run the same on CUDA tensors and, under
TRITON_INTERPRET=1, on CPU tensors: that is how the CPU test suite checks these very
kernels byte for byte against the torch reference. Index arithmetic is done in int64 so
caches past 2 GiB address correctly. Nothing here syncs or allocates beyond the op's
own result, so every launcher is safe inside CUDA graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.ops.triton_codecs import (
    BF16,
    DSV41_MXFP4,
    DSV41_MXFP8,
    DSV41_NVFP4,
    FP32,
    OCP_MXFP4,
    OCP_MXFP8,
    RAW,
    load_rows,
    round_trip_rows,
    store_rows,
)

CODES = {"dsv41_mxfp8": DSV41_MXFP8, "dsv41_nvfp4": DSV41_NVFP4, "dsv41_mxfp4": DSV41_MXFP4,
         "ocp_mxfp8": OCP_MXFP8, "ocp_mxfp4": OCP_MXFP4, "bf16": BF16, "fp32": FP32}
"""Triton codec of every format in `formats.FORMATS` (a test keeps the two in step)."""
_UNIT = {BF16: torch.int16, FP32: torch.int32}  # typed views for the bit formats
TILE_ELEMENTS = 2048  # elements per program: a few tokens of a 512-dim row


def format_code(fmt: str) -> int:
    """The kernels' code of a format name; an unknown name raises the reference's ValueError."""
    get_format(fmt)
    try:
        return CODES[fmt]
    except KeyError:
        raise NotImplementedError(f"{fmt}: no Triton codec for this cache format") from None


def tokens_per_tile(tokens: int, dim_p2: int) -> int:
    return max(1, min(triton.next_power_of_2(tokens), TILE_ELEMENTS // dim_p2))


def as_units(buf: torch.Tensor, fmt_code: int) -> torch.Tensor:
    """The cache bytes as the kernel stores them: bytes, or int16 / int32 units for bit formats."""
    return buf.view(_UNIT[fmt_code]) if fmt_code in _UNIT else buf


def word_view(*bufs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The widest common integer view (int32, int16 or bytes) of uint8 row buffers.

    Raw row copies move words, not bytes; every buffer gets the same word size so row
    offsets stay in one unit.
    """
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if all(b.shape[-1] % size == 0 and b.data_ptr() % size == 0
               and all(s % size == 0 for s in b.stride()[:-1]) for b in bufs):
            return tuple(b.view(dtype) for b in bufs)
    return bufs


# ---------------------------------------------------------------- put: encode and write


@triton.jit
def _store_tile(base, srcp, ok, FMT: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr, TOK: tl.constexpr):
    """Rows at pointers base [TOK, 1] = encode(rows at srcp [TOK, 1]) where ok [TOK, 1]."""
    d = tl.arange(0, DIM_P2)[None, :]
    if FMT == 4:  # RAW: already encoded rows, copied unit for unit
        tl.store(base + d, tl.load(srcp + d, mask=ok & (d < DIM)), mask=ok & (d < DIM))
    else:
        x = tl.load(srcp + d, mask=ok & (d < DIM), other=0.0)
        store_rows(base, x, ok, FMT, DIM, DIM_P2, TOK)


@triton.jit
def _put_rows(src, dst, row_ids, index, valid, T,
              s_r, s_t, d_s, d_t, FMT: tl.constexpr, SCATTER: tl.constexpr,
              DIM: tl.constexpr, DIM_P2: tl.constexpr, TOK: tl.constexpr):
    """Row r, tokens t of a tile: dst[r or row_ids[r], t or index[r, t]] = encode(src[r, t])."""
    r = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * TOK + tl.arange(0, TOK)
    ok = t < T
    if SCATTER:
        ok = ok & (tl.load(valid + r * T + t, mask=ok, other=0) != 0)
        slot = tl.load(row_ids + r).to(tl.int64)
        where = tl.load(index + r * T + t, mask=ok, other=0).to(tl.int64)
        base = dst + slot * d_s + where[:, None] * d_t
    else:
        base = dst + r * d_s + t[:, None].to(tl.int64) * d_t
    _store_tile(base, src + r * s_r + t[:, None].to(tl.int64) * s_t, ok[:, None], FMT, DIM, DIM_P2, TOK)


@triton.jit
def _put_slots(src, dst, slot_mapping, T, s_r, s_t, d_p, record, per_page,
               FMT: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr, TOK: tl.constexpr):
    """Row r, tokens t of a tile: record s % per_page of page s // per_page = encode(src[r, t]),
    s = slot_mapping[r, t] where >= 0 (d_p, record: page and record strides in dst units)."""
    r = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * TOK + tl.arange(0, TOK)
    slot = tl.load(slot_mapping + r * T + t, mask=t < T, other=-1).to(tl.int64)
    ok = slot >= 0  # -1: this token writes nothing (nor does a masked lane)
    base = dst + (slot // per_page) * d_p + (slot % per_page) * record
    _store_tile(base[:, None], src + r * s_r + t[:, None].to(tl.int64) * s_t, ok[:, None], FMT, DIM, DIM_P2, TOK)


def _source(dst: torch.Tensor, values: torch.Tensor, fmt: str):
    """(format code, dst in the kernel's units, values as the kernel reads them, values per row)."""
    if fmt == "bytes":
        code = RAW
        dst, src = word_view(dst, values)
    else:
        code = format_code(fmt)
        get_format(fmt).row_bytes(values.shape[-1])  # rejects a dim the format cannot hold
        dst, src = as_units(dst, code), values.to(torch.float32)
    src = src if src.stride(-1) == 1 else src.contiguous()
    return code, dst, src, src.shape[-1]


def _put(dst: torch.Tensor, values: torch.Tensor, fmt: str, row_ids=None, index=None, valid=None) -> None:
    """Encode values [R, T, dim] into dst rows: dst [R, >=T, bytes] or, scattering, [slots, n, bytes]."""
    R, T = values.shape[0], values.shape[1]
    if R == 0 or T == 0:
        return
    code, dst, src, dim = _source(dst, values, fmt)
    dim_p2 = triton.next_power_of_2(dim)
    tok = tokens_per_tile(T, dim_p2)
    scatter = row_ids is not None
    if scatter:
        index, valid = index.contiguous(), valid.contiguous()
    else:
        row_ids = index = valid = src  # unused when not scattering
    _put_rows[(R, triton.cdiv(T, tok))](
        src, dst, row_ids, index, valid, T, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        FMT=code, SCATTER=scatter, DIM=dim, DIM_P2=dim_p2, TOK=tok)


def stage_rows(staging: torch.Tensor, values: torch.Tensor, fmt: str) -> None:
    _put(staging, values, fmt)


def write_rows(cache, values, row_ids, index, valid, fmt: str) -> None:
    _put(cache, values, fmt, row_ids, index, valid)


def write_slots(cache, values, slot_mapping, fmt: str) -> None:
    """Encode values [R, T, dim] into the records of a paged cache [pages, page_bytes] that
    slot_mapping [R, T] names (-1: none); fmt "bytes" copies records [R, T, record_bytes]."""
    R, T = values.shape[0], values.shape[1]
    if R == 0 or T == 0:
        return
    code, pages, src, dim = _source(cache, values, fmt)
    record_bytes = values.shape[-1] if fmt == "bytes" else get_format(fmt).row_bytes(dim)
    unit = pages.element_size()  # the record's size in the units the kernel moves
    dim_p2 = triton.next_power_of_2(dim)
    tok = tokens_per_tile(T, dim_p2)
    _put_slots[(R, triton.cdiv(T, tok))](
        src, pages, slot_mapping.contiguous(), T, src.stride(0), src.stride(1), pages.stride(0),
        record_bytes // unit, cache.shape[1] // record_bytes, FMT=code, DIM=dim, DIM_P2=dim_p2, TOK=tok)


# ---------------------------------------------------------------- get: read and decode


@triton.jit
def _get_rows(src, out, row_ids, index, T, N,
              s_s, s_t, FMT: tl.constexpr, GATHER: tl.constexpr,
              DIM: tl.constexpr, DIM_P2: tl.constexpr, TOK: tl.constexpr):
    """out[r, t] = decode(src[r, t]) or, gathering, decode(src[row_ids[r], index[r, t] mod N])."""
    r = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * TOK + tl.arange(0, TOK)
    ok = t < T
    if GATHER:
        slot = tl.load(row_ids + r).to(tl.int64)
        where = tl.load(index + r * T + t, mask=ok, other=0).to(tl.int64) % N
        where = tl.where(where < 0, where + N, where)  # Python-style modulo, either % semantics
        base = src + slot * s_s + where[:, None] * s_t
    else:
        base = src + r * s_s + t[:, None].to(tl.int64) * s_t
    ok = ok[:, None]
    x = load_rows(base, ok, FMT, DIM, DIM_P2, TOK)
    d = tl.arange(0, DIM_P2)[None, :]
    tl.store(out + (r * T + t[:, None]) * DIM + d, x, mask=ok & (d < DIM))


def _get(src: torch.Tensor, tokens: int, dim: int, fmt: str, row_ids=None, index=None) -> torch.Tensor:
    code = format_code(fmt)
    get_format(fmt).row_bytes(dim)
    rows = src.shape[0] if row_ids is None else row_ids.shape[0]
    out = torch.empty((rows, tokens, dim), dtype=torch.float32, device=src.device)
    if rows == 0 or tokens == 0:
        return out
    units = as_units(src, code)
    dim_p2 = triton.next_power_of_2(dim)
    tok = tokens_per_tile(tokens, dim_p2)
    gather = row_ids is not None
    if gather:
        index = index.contiguous()
    else:
        row_ids = index = out  # unused when not gathering
    _get_rows[(rows, triton.cdiv(tokens, tok))](
        units, out, row_ids, index, tokens, units.shape[1], units.stride(0), units.stride(1),
        FMT=code, GATHER=gather, DIM=dim, DIM_P2=dim_p2, TOK=tok)
    return out


def read_rows(staging: torch.Tensor, dim: int, fmt: str) -> torch.Tensor:
    return _get(staging, staging.shape[1], dim, fmt)


def window_read(staging: torch.Tensor, tokens: int, dim: int, fmt: str) -> torch.Tensor:
    view = staging.view(staging.shape[0], -1, staging.shape[-1])  # layout.token_view
    return _get(view, tokens, dim, fmt)


def gather_rows(cache, row_ids, index, dim: int, fmt: str) -> torch.Tensor:
    return _get(cache, index.shape[1], dim, fmt, row_ids, index)


# ---------------------------------------------------------------- round trip


@triton.jit
def _round_trip(x_ptr, out, N, FMT: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr,
                TOK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64) * TOK + tl.arange(0, TOK)[:, None]
    d = tl.arange(0, DIM_P2)[None, :]
    ok = (n < N) & (d < DIM)
    x = tl.load(x_ptr + n * DIM + d, mask=ok, other=0.0)
    tl.store(out + n * DIM + d, round_trip_rows(x, FMT, DIM_P2, TOK), mask=ok)


def round_trip(values: torch.Tensor, fmt: str) -> torch.Tensor:
    code = format_code(fmt)
    dim = values.shape[-1]
    get_format(fmt).row_bytes(dim)
    x = values.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    n = x.numel() // dim if dim else 0
    if n:
        dim_p2 = triton.next_power_of_2(dim)
        tok = tokens_per_tile(n, dim_p2)
        _round_trip[(triton.cdiv(n, tok),)](x, out, n, FMT=code, DIM=dim, DIM_P2=dim_p2, TOK=tok)
    return out
