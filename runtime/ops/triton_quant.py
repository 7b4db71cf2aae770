"""Triton kernels for the quantized linears of `quant_ops`, decoding weights in registers.

* `fp8_block_linear`: each program computes a [BM, BN] tile of the output; per K step of
  32 inputs (inside one scale block for every block shape: 32 divides 128 and 32) it loads
  the E4M3 weight bytes and one scale per output row, decodes them on the bits
  (`triton_codecs.e4m3_value`) and multiplies with `tl.dot`.
* `fp4_expert_linear`: rows are grouped by expert on the device (a stable sort of the ids,
  per-expert counts and a tile table, all without a host sync, so it captures in a CUDA
  graph); each program takes a [BM] tile of one expert's rows and decodes that expert's
  packed nibbles and 1x32 UE8M0 scales in registers, as Marlin's W4A16 path does on
  Hopper, which has no FP4 math.

Decoded weights are exact in float32. The dot runs in bfloat16 where both operands are
exact in it -- UE8M0-scaled weights (E4M3 or E2M1 times a power of two) with activations
that are bfloat16 or quantized by DeepSeek's rule (E4M3 times a power of two) -- so the
tensor cores multiply exactly and accumulate in float32; otherwise in IEEE float32.
(Exact down to products below 2^-133, bfloat16's smallest subnormal: weight scales under
2^-118, which no checkpoint holds.) In Triton's interpreter the float32 path always runs.
Either way the result differs from the reference only
in float32 accumulation order. DeepSeek's activation rule runs first as its own kernel,
bitwise the reference's `act_quant_e4m3`.

At decode sizes these linears are bound by weight bytes, so the K loop is a plain
pipelined loop; the FP8 tensor-core path (E4M3 x E4M3 with per-block rescaling) is not
used yet.

Like the rest of the op set, the kernels never validate indices: expert ids outside the
weight's experts are the caller's error.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from b12x_toolchain.runtime.formats.weight_formats import ACT_GROUP, check_fp4, check_fp8_block
from b12x_toolchain.runtime.ops.quant_ops import check_act_rule, check_expert_ids
from b12x_toolchain.runtime.ops.triton_codecs import (
    _e2m1_value,
    _magnitude,
    _ue8m0_value,
    _unpack_nibbles,
    e4m3_code,
    e4m3_value,
)

BM, BN, BK = 16, 64, 32  # output rows and columns per program; inputs per K step
TOK = 16  # tokens per program of the activation kernel


@triton.jit
def _act_quant_kernel(x, out, rows, n, TOK: tl.constexpr, GROUP: tl.constexpr):
    r = tl.program_id(0) * TOK + tl.arange(0, TOK)[:, None]
    c = tl.program_id(1) * GROUP + tl.arange(0, GROUP)[None, :]
    live = (r < rows) & (c < n)
    at = r.to(tl.int64) * n + c
    bits = tl.load(x + at, mask=live, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    mag, _ = _magnitude(bits)
    non_finite = tl.max(((bits & 0x7F800000) == 0x7F800000).to(tl.int32), axis=1) > 0
    amax = tl.max(mag, axis=1).to(tl.float32, bitcast=True)
    floor = tl.full(amax.shape, 0x38D1B717, tl.int32).to(tl.float32, bitcast=True)  # float32(1e-4)
    q = tl.math.div_rn(tl.maximum(amax, floor), tl.full(amax.shape, 448.0, tl.float32))
    qbits = q.to(tl.int32, bitcast=True)
    e = (qbits >> 23) - 127 + ((qbits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2 q), exact
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    y = e4m3_value(e4m3_code(bits, e[:, None])) * scale[:, None]
    tl.store(out + at, tl.where(non_finite[:, None], float("nan"), y), mask=live)


def _activations(x2: torch.Tensor, act_rule: str) -> torch.Tensor:
    """[rows, in] activations for the GEMMs: x itself (contiguous), or DeepSeek's rule applied."""
    check_act_rule(act_rule)
    if act_rule == "none":
        return x2.contiguous()
    src = x2.contiguous()
    out = torch.empty(src.shape, dtype=torch.float32, device=src.device)
    rows, n = src.shape
    if rows:
        _act_quant_kernel[(triton.cdiv(rows, TOK), triton.cdiv(n, ACT_GROUP))](src, out, rows, n, TOK=TOK,
                                                                              GROUP=ACT_GROUP)
    return out


def act_quant_e4m3(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's activation rule by the Triton kernel: float32, bitwise `weight_formats.act_quant_e4m3`."""
    return _activations(x.reshape(-1, x.shape[-1]), "deepseek").view(x.shape)


def _dot_bf16(xa: torch.Tensor, weight_scale_ue8m0: bool, act_rule: str) -> bool:
    # Triton's interpreter (CPU tensors) multiplies bfloat16 tiles as their integer bits,
    # so there the float32 path runs.
    exact = weight_scale_ue8m0 and (act_rule == "deepseek" or xa.dtype == torch.bfloat16)
    return exact and xa.is_cuda


@triton.jit
def _dot(acc, xt, wt, DOT_BF16: tl.constexpr):
    """acc + xt [BM, BK] @ wt.T ([BN, BK] weights), exact products in either precision."""
    if DOT_BF16:
        return tl.dot(xt.to(tl.bfloat16), tl.trans(wt.to(tl.bfloat16)), acc)
    return tl.dot(xt.to(tl.float32), tl.trans(wt), acc, input_precision="ieee")


@triton.jit
def _fp8_linear_kernel(x, w, s, out, m, n_out, n_in, grid_n, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                       SCALE_UE8M0: tl.constexpr, DOT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    row_ok = rows < m
    col_ok = cols < n_out
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, n_in, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < n_in
        xt = tl.load(x + rows[:, None].to(tl.int64) * n_in + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                     other=0.0)
        codes = tl.load(w + cols[:, None].to(tl.int64) * n_in + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                        other=0).to(tl.int32)
        # The whole K step lies in scale column k0 // BLOCK_COLS (BK divides BLOCK_COLS).
        at = (cols // BLOCK_ROWS) * grid_n + k0 // BLOCK_COLS
        if SCALE_UE8M0:
            scale = _ue8m0_value(tl.load(s + at, mask=col_ok, other=127).to(tl.int32))
        else:
            scale = tl.load(s + at, mask=col_ok, other=1.0)
        acc = _dot(acc, xt, e4m3_value(codes) * scale[:, None], DOT_BF16)
    tl.store(out + rows[:, None].to(tl.int64) * n_out + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_m: int, block_n: int,
                     act_rule: str) -> torch.Tensor:
    check_fp8_block(weight, scale, (block_m, block_n))
    n_out, n_in = weight.shape
    xa = _activations(x.reshape(-1, n_in), act_rule)
    m = xa.shape[0]
    out = torch.empty((m, n_out), dtype=torch.float32, device=x.device)
    ue8m0 = scale.dtype == torch.float8_e8m0fnu
    if m and n_out:
        s = scale.view(torch.uint8) if ue8m0 else scale
        _fp8_linear_kernel[(triton.cdiv(m, BM), triton.cdiv(n_out, BN))](
            xa, weight.contiguous().view(torch.uint8), s.contiguous(), out, m, n_out, n_in, scale.shape[1],
            BLOCK_ROWS=block_m, BLOCK_COLS=block_n, SCALE_UE8M0=ue8m0, DOT_BF16=_dot_bf16(xa, ue8m0, act_rule),
            BM=BM, BN=BN, BK=BK)
    return out.view(*x.shape[:-1], n_out)


@triton.jit
def _fp4_expert_kernel(x, order, tile_expert, tile_first, row_start, counts, w, s, out, n_out, n_in, experts,
                       DOT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert + tile)
    live = expert < experts  # tiles past the last expert's have nothing to do
    expert = tl.minimum(expert, experts - 1).to(tl.int64)
    local = (tile - tl.load(tile_first + expert)) * BM + tl.arange(0, BM)
    row_ok = live & (local < tl.load(counts + expert))
    src = tl.load(order + tl.load(row_start + expert) + local, mask=row_ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < n_out
    packed_row = (expert * n_out + cols) * (n_in // 2)  # [BN]
    scale_row = (expert * n_out + cols) * (n_in // 32)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, n_in, BK):  # n_in is a multiple of 32 (the format), BK == 32
        xt = tl.load(x + src[:, None] * n_in + k0 + tl.arange(0, BK)[None, :], mask=row_ok[:, None], other=0.0)
        packed = tl.load(w + packed_row[:, None] + k0 // 2 + tl.arange(0, BK // 2)[None, :], mask=col_ok[:, None],
                         other=0).to(tl.int32)
        scale = _ue8m0_value(tl.load(s + scale_row + k0 // 32, mask=col_ok, other=127).to(tl.int32))
        acc = _dot(acc, xt, _e2m1_value(_unpack_nibbles(packed, BN, BK)) * scale[:, None], DOT_BF16)
    tl.store(out + src[:, None] * n_out + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def expert_tiles(ids: torch.Tensor, experts: int, tile_rows: int) -> dict[str, torch.Tensor]:
    """Rows grouped by expert in tiles of `tile_rows`, from device ops only (no host sync).

    ``order``: row indices sorted by expert (stable); ``counts``/``row_start``: each
    expert's rows and where they start in ``order``; ``tile_first``: each expert's first
    tile; ``tile_expert``: the expert of every tile slot, ``experts`` for the slots past the
    last tile. The slots are a static bound: sum(ceil(count / tile_rows)) is at most
    ceil(rows / tile_rows) + min(experts, rows).
    """
    ids = ids.reshape(-1).long()
    rows = ids.shape[0]
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    tiles = (counts + tile_rows - 1) // tile_rows
    tile_end = tiles.cumsum(0)
    slots = torch.arange(triton.cdiv(rows, tile_rows) + min(experts, rows), device=ids.device)
    int32 = torch.int32
    return {"order": torch.argsort(ids, stable=True).to(int32),
            "tile_expert": torch.searchsorted(tile_end, slots, right=True).to(int32),
            "tile_first": (tile_end - tiles).to(int32), "row_start": (counts.cumsum(0) - counts).to(int32),
            "counts": counts.to(int32)}


def fp4_expert_linear(x: torch.Tensor, expert_ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      act_rule: str) -> torch.Tensor:
    check_fp4(weight, scale)
    check_expert_ids(x, expert_ids)
    experts, n_out, n_in = weight.shape[0], weight.shape[1], 2 * weight.shape[2]
    xa = _activations(x.reshape(-1, n_in), act_rule)
    rows = xa.shape[0]
    out = torch.empty((rows, n_out), dtype=torch.float32, device=x.device)
    if rows and n_out:
        t = expert_tiles(expert_ids, experts, BM)
        _fp4_expert_kernel[(t["tile_expert"].shape[0], triton.cdiv(n_out, BN))](
            xa, t["order"], t["tile_expert"], t["tile_first"], t["row_start"], t["counts"],
            weight.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8), out, n_out, n_in, experts,
            DOT_BF16=_dot_bf16(xa, True, act_rule), BM=BM, BN=BN, BK=BK)
    return out.view(*x.shape[:2], n_out)
