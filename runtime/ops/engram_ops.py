"""Op set v6's Engram ops: DeepSeek V4.1's n-gram hash, and the embedding-row lookup it drives.

An Engram layer looks up, for every token, one embedding row per (order, head) hash
column: orders 2..n of the n-gram ending at the token, H heads per order, each with its
own prime modulus. `engram_hash` computes the row ids from compressed token ids alone,
so a pass can hash all its tokens before its first layer; `engram_lookup` gathers and
decodes those rows.

Hashing (DeepSeek's reference, exactly). A pass row's tokens are `ids` [R, T], preceded
by `lookback` [R, n-1], the n-1 tokens before the row's first one (oldest first). Token
t's window is v_k = s[t + n-1 - k] for k = 0..n-1 (k tokens back) in s = lookback ++ ids.
-1 marks a dead token (an image span) or a position before the sequence start; blocking
is cumulative, so a dead slot pads itself and every older slot with `pad_id`. Then
r_1 = v_0*m_0 XOR v_1*m_1, r_i = r_{i-1} XOR v_i*m_i, and column c = (i-1)*H + h of
order i+1 is r_i mod p_c + offset_c, offset the exclusive prefix sum of the primes, so a
layer's columns tile its one table from row 0. The multipliers' bound
(exporter/model/engram_hashing.py) keeps all of it non-negative int64. Because a token's
hash depends only on its own window, a sequence hashes the same in one call, in chunks,
or a token at a time, given the right lookback.

Lookup. The table is stored as the checkpoint stores it: E4M3 with one UE8M0 scale per 32
values (the FP8 (1, 32) block format, formats/weight_formats.py), or float32 / bfloat16
rows. FP8 rows decode exactly to float32 and round to bfloat16, as DeepSeek's reference
does; other rows come back as stored. Tables hold hundreds of millions of rows, so only
the rows named are read, and the result lies on row_ids' device whatever the table's.

The Triton kernels (`triton_engram`) are bit-exact with these references. Like the rest
of the op set, neither validates ids: row ids outside the table are the caller's error.
"""

from __future__ import annotations

from typing import Optional

import torch

from b12x_toolchain.runtime.formats.weight_formats import check_fp8_block, decode_fp8_block
from b12x_toolchain.runtime.ops.define import fake_for, reference_op

DEAD = -1  # a dead token (an image span), or none: before the sequence start
SCALE_BLOCK = (1, 32)  # one UE8M0 scale per 32 values of a row
STORED_DTYPES = (torch.float32, torch.bfloat16)  # tables read back as stored


def check_engram_hash(ids: torch.Tensor, lookback: torch.Tensor, multipliers: list[int], primes: list[int]) -> int:
    """Refuse, naming it, any input `engram_hash` does not take; return the hash columns, (n-1)*H."""
    n = len(multipliers)
    if n < 2:
        raise ValueError(f"multipliers must hold one per n-gram slot, n >= 2, not {n} ({list(multipliers)})")
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise ValueError(f"ids must be int64 [rows, tokens], not {ids.dtype} {list(ids.shape)}")
    if lookback.dtype != torch.int64 or tuple(lookback.shape) != (ids.shape[0], n - 1):
        raise ValueError(f"lookback must be int64 [rows, n-1] = {[ids.shape[0], n - 1]} for {n} multipliers, "
                         f"not {lookback.dtype} {list(lookback.shape)}")
    if not primes or len(primes) % (n - 1):
        raise ValueError(f"primes must hold (n-1) * heads = a positive multiple of {n - 1} moduli, "
                         f"not {len(primes)}")
    return len(primes)


def prime_offsets(primes: list[int]) -> list[int]:
    """Each column's first table row: the exclusive prefix sum of the primes."""
    offsets, total = [], 0
    for p in primes:
        offsets.append(total)
        total += p
    return offsets


@reference_op()
def engram_hash(ids: torch.Tensor, lookback: torch.Tensor, multipliers: list[int], primes: list[int],
                pad_id: int) -> torch.Tensor:
    """int64 [R, T, (n-1)*H]: each token's table row per (order, head) column."""
    columns = check_engram_hash(ids, lookback, multipliers, primes)
    n, tokens = len(multipliers), ids.shape[1]
    heads = columns // (n - 1)
    seq = torch.cat([lookback, ids], dim=1)
    blocked = torch.zeros_like(ids, dtype=torch.bool)
    primes_t = torch.tensor(primes, dtype=torch.int64, device=ids.device).view(n - 1, heads)
    offsets_t = torch.tensor(prime_offsets(primes), dtype=torch.int64, device=ids.device).view(n - 1, heads)
    out = ids.new_empty((*ids.shape, columns))
    r = torch.zeros_like(ids)
    for k in range(n):
        v = seq[:, n - 1 - k : n - 1 - k + tokens]  # each token's slot k: k tokens back
        blocked = blocked | (v == DEAD)  # cumulative: a dead slot pads every older one too
        r = r ^ (torch.where(blocked, pad_id, v) * multipliers[k])
        if k:  # r is now r_k, the hash of order k + 1
            out[..., (k - 1) * heads : k * heads] = r[..., None] % primes_t[k - 1] + offsets_t[k - 1]
    return out


def check_engram_table(table: torch.Tensor, scale: Optional[torch.Tensor], row_ids: torch.Tensor) -> int:
    """Refuse, naming it, any input `engram_lookup` does not take; return the row width."""
    if table.dim() != 2:
        raise ValueError(f"an Engram table is 2-d [rows, dim], not {list(table.shape)}")
    if table.dtype == torch.float8_e4m3fn:
        if scale is None or scale.dtype != torch.float8_e8m0fnu:
            raise ValueError(f"a float8_e4m3fn Engram table needs a float8_e8m0fnu scale [rows, dim/32], "
                             f"not {None if scale is None else scale.dtype}")
        check_fp8_block(table, scale, SCALE_BLOCK)
    elif table.dtype in STORED_DTYPES:
        if scale is not None:
            raise ValueError(f"a {table.dtype} Engram table takes no scale, not {scale.dtype} {list(scale.shape)}")
    else:
        raise ValueError(f"an Engram table is float8_e4m3fn (with a UE8M0 scale), float32 or bfloat16, "
                         f"not {table.dtype}")
    if row_ids.dtype != torch.int64 or row_ids.dim() < 1:
        raise ValueError(f"row_ids must be int64 [..., columns], not {row_ids.dtype} {list(row_ids.shape)}")
    return table.shape[1]


def lookup_dtype(table: torch.Tensor) -> torch.dtype:
    """What the lookup returns: bfloat16 for FP8 rows (DeepSeek's cast), else the table's dtype."""
    return torch.bfloat16 if table.dtype == torch.float8_e4m3fn else table.dtype


@reference_op()
def engram_lookup(table: torch.Tensor, scale: Optional[torch.Tensor], row_ids: torch.Tensor) -> torch.Tensor:
    """[..., C*dim] on row_ids' device: table rows row_ids[..., c], decoded, concatenated in column order."""
    dim = check_engram_table(table, scale, row_ids)
    at = row_ids.to(table.device)
    rows = table[at]  # only the rows named: never the whole table
    if scale is not None:
        rows = decode_fp8_block(rows.view(-1, dim), scale[at].view(-1, scale.shape[1]), SCALE_BLOCK).to(torch.bfloat16)
    return rows.reshape(*row_ids.shape[:-1], row_ids.shape[-1] * dim).to(row_ids.device)


@fake_for(engram_hash)
def _(ids, lookback, multipliers, primes, pad_id):
    return ids.new_empty((*ids.shape, check_engram_hash(ids, lookback, multipliers, primes)))


@fake_for(engram_lookup)
def _(table, scale, row_ids):
    dim = check_engram_table(table, scale, row_ids)
    return row_ids.new_empty((*row_ids.shape[:-1], row_ids.shape[-1] * dim), dtype=lookup_dtype(table))


ENGRAM_OPS = ("engram_hash", "engram_lookup")
