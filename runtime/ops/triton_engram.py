"""Triton kernels for Engram's ops (engram_ops.py), bit-exact with the references.

* `engram_hash`: one program per block of a row's tokens. The multipliers, primes and
  column offsets are compile-time constants (one compilation per layer's constants), so
  a call copies nothing from the host and captures in a CUDA graph, and each modulus is a
  division by a constant. The int64 products, XORs and remainders are the reference's
  operations on the same non-negative values, so the ids are identical.
* `engram_lookup`: one program per (token, column) row and block of its values. FP8 rows
  decode on the bits (`triton_codecs.e4m3_value`, exact in float32) times their UE8M0
  scale (the reference's float32 multiply by a power of two) and round to bfloat16 to
  nearest even on the bits, as torch's cast does (a NaN, which no checkpoint row holds,
  comes back as a NaN, its payload not promised); float32 and bfloat16 rows are copied
  as their integer bits. The table may be a pinned host tensor while row_ids is on the GPU:
  pinned memory is mapped into the device's unified address space, so the kernel reads
  the rows it needs in place, over the bus, from inside a captured graph, and never
  copies the table. A pageable host table has no device address and is refused.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from b12x_toolchain.runtime.ops.engram_ops import (
    DEAD,
    SCALE_BLOCK,
    check_engram_hash,
    check_engram_table,
    lookup_dtype,
    prime_offsets,
)
from b12x_toolchain.runtime.ops.triton_codecs import _ue8m0_value, e4m3_value

HASH_BLOCK = 128  # tokens per hash program
LOOKUP_BLOCK = 256  # row values per lookup program: one Engram head row of V4.1
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}  # stored rows copy as these


@triton.jit
def _hash_kernel(ids, lookback, out, tokens, pad_id, MULTIPLIERS: tl.constexpr, PRIMES: tl.constexpr,
                 OFFSETS: tl.constexpr, N: tl.constexpr, HEADS: tl.constexpr, DEAD: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = t < tokens
    blocked = t < 0  # all False
    r = tl.zeros([BLOCK], tl.int64)
    out_at = out + (row * tokens + t) * ((N - 1) * HEADS)
    for k in tl.static_range(N):
        pos = t - k  # k tokens back: in ids, or in the lookback before them
        in_ids = pos >= 0
        v = tl.where(in_ids, tl.load(ids + row * tokens + pos, mask=live & in_ids, other=0),
                     tl.load(lookback + row * (N - 1) + (N - 1) + pos, mask=live & (pos < 0), other=0))
        blocked = blocked | (v == DEAD)
        r = r ^ (tl.where(blocked, pad_id, v) * MULTIPLIERS[k])
        if k > 0:
            for h in tl.static_range(HEADS):
                # Column (k - 1) * HEADS + h, written out each time: Triton before 3.7 refuses
                # to bind a constexpr name again in a later unrolled iteration.
                tl.store(out_at + (k - 1) * HEADS + h,
                         r % PRIMES[(k - 1) * HEADS + h] + OFFSETS[(k - 1) * HEADS + h], mask=live)


def engram_hash(ids: torch.Tensor, lookback: torch.Tensor, multipliers: list[int], primes: list[int],
                pad_id: int) -> torch.Tensor:
    columns = check_engram_hash(ids, lookback, multipliers, primes)
    rows, tokens = ids.shape
    out = torch.empty((rows, tokens, columns), dtype=torch.int64, device=ids.device)
    if out.numel():
        n = len(multipliers)
        _hash_kernel[(rows, triton.cdiv(tokens, HASH_BLOCK))](
            ids.contiguous(), lookback.contiguous(), out, tokens, pad_id, MULTIPLIERS=tuple(multipliers),
            PRIMES=tuple(primes), OFFSETS=tuple(prime_offsets(primes)), N=n, HEADS=columns // (n - 1), DEAD=DEAD,
            BLOCK=HASH_BLOCK)
    return out


@triton.jit
def _bf16_bits(x):
    """int16 bfloat16 bits of float32 x, rounded to nearest even on the bits (NaN -> 0x7FC0).

    A cast would do the same on a GPU, but Triton's interpreter rounds float32 subnormals
    to bfloat16 wrongly; integer rounding is the same everywhere.
    """
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _lookup_kernel(table, scale, row_ids, out, dim, table_stride, scale_stride, FP8: tl.constexpr,
                   BLOCK: tl.constexpr, GROUP: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # the (token, column) pair: out row i of [tokens * columns, dim]
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = d < dim
    row = tl.load(row_ids + i)
    values = tl.load(table + row * table_stride + d, mask=ok, other=0)
    if FP8:
        scales = tl.load(scale + row * scale_stride + d // GROUP, mask=ok, other=127).to(tl.int32)
        values = _bf16_bits(e4m3_value(values.to(tl.int32)) * _ue8m0_value(scales))
    tl.store(out + i * dim + d, values, mask=ok)


def _readable_from(t: torch.Tensor, device: torch.device, what: str) -> None:
    """Refuse a host tensor a kernel on `device` cannot address: only pinned memory is mapped."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        raise ValueError(f"the Engram {what} is in pageable host memory, which a CUDA kernel cannot read; "
                         "pin it (tensor.pin_memory()) or move it to the GPU")
    if t.dim() and t.stride(-1) != 1:
        raise ValueError(f"the Engram {what} must have contiguous rows (stride 1 along dim), not strides {t.stride()}")


def engram_lookup(table: torch.Tensor, scale: Optional[torch.Tensor], row_ids: torch.Tensor) -> torch.Tensor:
    dim = check_engram_table(table, scale, row_ids)
    fp8 = scale is not None
    for t, what in ((table, "table"), (scale, "scale")) if fp8 else ((table, "table"),):
        _readable_from(t, row_ids.device, what)
    columns = row_ids.shape[-1]
    out = torch.empty((*row_ids.shape[:-1], columns * dim), dtype=lookup_dtype(table), device=row_ids.device)
    flat_ids = row_ids.reshape(-1)
    if out.numel():
        if fp8:
            src, dst, scales, scale_stride = table.view(torch.uint8), out.view(torch.int16), scale.view(torch.uint8), scale.stride(0)
        else:  # copied as integer bits: every byte as stored, NaN payloads included
            bits = _BITS[table.dtype]
            src, dst, scales, scale_stride = table.view(bits), out.view(bits), flat_ids, 0  # flat_ids: unread
        _lookup_kernel[(flat_ids.shape[0], triton.cdiv(dim, LOOKUP_BLOCK))](
            src, scales, flat_ids.contiguous(), dst, dim, table.stride(0), scale_stride, FP8=fp8,
            BLOCK=LOOKUP_BLOCK, GROUP=SCALE_BLOCK[1])
    return out
