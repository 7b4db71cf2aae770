"""Triton kernels for the linears of `quant_ops`, decoding quantized weights in registers.

Every kernel tiles the output in fixed [BM, BN] tiles and sums a tile's whole K in one
loop of fixed BK steps: a row's result never depends on how many rows the call holds
(no tile size or split of K chosen by the shape), as `quant_ops` requires.

* `dense_linear`: float32 weights, an IEEE float32 dot.
* `fp8_block_linear`: each program computes a [BM, BN] tile of the output; per K step of
  32 inputs (inside one scale block for every block shape: 32 divides 128 and 32, and
  inside one 128-channel activation group) it loads the E4M3 weight bytes and one scale
  per output row, and multiplies with `tl.dot` in one of three ways (`fp8_linear_dot`).
* `fp4_expert_linear`: rows are grouped by expert on the device (a stable sort of the ids,
  per-expert counts and a tile table, all without a host sync, so it captures in a CUDA
  graph); each program takes a [BM] tile of one expert's rows and decodes that expert's
  packed nibbles and 1x32 UE8M0 scales in registers, as Marlin's W4A16 path does on
  Hopper, which has no FP4 math.

The FP8 dot, where activations follow DeepSeek's rule (E4M3 times a power of two per 128
channels, `triton_act_quant.act_quant_codes`) and the device multiplies E4M3 on its
tensor cores (compute capability 8.9 and up): both operands go to `tl.dot` as the stored
E4M3 bytes, so a weight byte is read and multiplied without being decoded. Each K step's
dot starts from zero and is promoted into the float32 accumulator times the activation
scale (per row) and the weight scale (per output row), as DeepGEMM does: the scales
cannot enter the MMA, and Hopper's FP8 MMA keeps fewer bits than float32 while it
accumulates, which a fresh sum of 32 products confines to one step. E4M3 products are
exact and a power-of-two activation scale multiplies exactly, so where the MMA sums a
step in float32 (as the interpreter does) the result differs from the reference only by
float32 rounding; how far Hopper's shorter sums move it, `benchmarks/gpu_check.py`
measures against the same bound. A group holding inf or NaN has a NaN scale, which makes
its row NaN as in the reference.

Otherwise the weights are decoded on the bits (`triton_codecs.e4m3_value`, exact in
float32) and the dot runs in bfloat16 where both operands are exact in it -- UE8M0-scaled
weights (E4M3 or E2M1 times a power of two) with activations that are bfloat16 or
quantized by DeepSeek's rule -- so the tensor cores multiply exactly and accumulate in
float32; otherwise in IEEE float32. (Exact down to products below 2^-133, bfloat16's
smallest subnormal: weight scales under 2^-118, which no checkpoint holds.) Either way
the result differs from the reference only in float32 accumulation order. DeepSeek's
activation rule runs first as its own kernel, bitwise the reference's `act_quant_e4m3`.

At decode sizes these linears are bound by weight bytes whichever dot runs, so the K loop
is a plain pipelined loop.

Triton's interpreter multiplies bfloat16 tiles as their integer bits, so on CPU tensors
the float32 dot runs unless a caller names another (`fp8_block_linear_by`); it executes
the FP8 dot exactly (E4M3 operands widened, float32 products and sums), which is how the
tests check that dot's arithmetic without a GPU.

Like the rest of the op set, the kernels never validate indices: expert ids outside the
weight's experts are the caller's error.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from b12x_toolchain.runtime.formats.weight_formats import ACT_GROUP, check_fp4, check_fp8_block
from b12x_toolchain.runtime.ops.quant_ops import check_act_rule, check_expert_ids
from b12x_toolchain.runtime.ops.triton_act_quant import act_quant_codes, act_quant_values
from b12x_toolchain.runtime.ops.triton_codecs import _e2m1_value, _ue8m0_value, _unpack_nibbles, e4m3_value

BM, BN, BK = 16, 64, 32  # output rows and columns per program; inputs per K step
FP8_MMA_CAPABILITY = (8, 9)  # Ada, Hopper and later multiply E4M3 x E4M3 on tensor cores
DOTS = ("fp8", "bf16", "fp32")


def _activations(x2: torch.Tensor, act_rule: str) -> torch.Tensor:
    """float32 [rows, in] activations for the bfloat16 and float32 dots: x itself (contiguous), or DeepSeek's rule."""
    check_act_rule(act_rule)
    return x2.contiguous() if act_rule == "none" else act_quant_values(x2)


def _exact_in_bf16(act_rule: str, scale_ue8m0: bool, x_dtype: torch.dtype) -> bool:
    # Decoded weights are exact in bfloat16 when their scales are powers of two, and so are
    # activations quantized by DeepSeek's rule or given in bfloat16.
    return scale_ue8m0 and (act_rule == "deepseek" or x_dtype == torch.bfloat16)


def _capability(t: torch.Tensor) -> tuple[int, int] | None:
    """Compute capability of the CUDA device holding t; None for CPU tensors (Triton's interpreter)."""
    if not t.is_cuda:
        return None
    if torch.version.hip:  # ROCm's FP8 formats differ by device: no E4M3FN MMA assumed
        return (0, 0)
    return torch.cuda.get_device_capability(t.device)


def fp8_linear_dot(capability: tuple[int, int] | None, act_rule: str, scale_ue8m0: bool,
                   x_dtype: torch.dtype) -> str:
    """The dot `fp8_block_linear` runs: ``"fp8"``, ``"bf16"`` or ``"fp32"`` (see the module docstring).

    `capability` is the CUDA device's (major, minor), None in Triton's interpreter, which
    multiplies bfloat16 tiles as their integer bits and so always takes the float32 dot.
    """
    check_act_rule(act_rule)
    if capability is None:
        return "fp32"
    if act_rule == "deepseek" and tuple(capability) >= FP8_MMA_CAPABILITY:
        return "fp8"
    return "bf16" if _exact_in_bf16(act_rule, scale_ue8m0, x_dtype) else "fp32"


@triton.jit
def _dot(acc, xt, wt, DOT_BF16: tl.constexpr):
    """acc + xt [BM, BK] @ wt.T ([BN, BK] weights), exact products in either precision."""
    if DOT_BF16:
        return tl.dot(xt.to(tl.bfloat16), tl.trans(wt.to(tl.bfloat16)), acc)
    return tl.dot(xt.to(tl.float32), tl.trans(wt), acc, input_precision="ieee")


@triton.jit
def _output_tile(m, n_out, BM: tl.constexpr, BN: tl.constexpr):
    """This program's output rows and columns, and which of them exist."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    return rows, cols, rows < m, cols < n_out


@triton.jit
def _fp8_linear_kernel(x, x_scale, w, s, out, m, n_out, n_in, grid_n, act_groups, BLOCK_ROWS: tl.constexpr,
                       BLOCK_COLS: tl.constexpr, SCALE_UE8M0: tl.constexpr, DOT: tl.constexpr, ACT_GROUP: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows, cols, row_ok, col_ok = _output_tile(m, n_out, BM, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, n_in, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < n_in
        x_at = x + rows[:, None].to(tl.int64) * n_in + k[None, :]
        codes = tl.load(w + cols[:, None].to(tl.int64) * n_in + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                        other=0)
        # The whole K step lies in scale column k0 // BLOCK_COLS (BK divides BLOCK_COLS) and,
        # for the FP8 dot, in activation group k0 // ACT_GROUP (BK divides ACT_GROUP).
        at = (cols // BLOCK_ROWS) * grid_n + k0 // BLOCK_COLS
        if SCALE_UE8M0:
            scale = _ue8m0_value(tl.load(s + at, mask=col_ok, other=127).to(tl.int32))
        else:
            scale = tl.load(s + at, mask=col_ok, other=1.0)
        if DOT == "fp8":
            xq = tl.load(x_at, mask=row_ok[:, None] & k_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
            x_s = tl.load(x_scale + rows.to(tl.int64) * act_groups + k0 // ACT_GROUP, mask=row_ok, other=1.0)
            # A fresh float32 sum of this step's exact E4M3 products, promoted into the
            # accumulator with both scales: the tensor cores never accumulate across steps.
            acc += tl.dot(xq, tl.trans(codes.to(tl.float8e4nv, bitcast=True))) * (x_s[:, None] * scale[None, :])
        else:
            xt = tl.load(x_at, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(acc, xt, e4m3_value(codes.to(tl.int32)) * scale[:, None], DOT == "bf16")
    tl.store(out + rows[:, None].to(tl.int64) * n_out + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def fp8_block_linear_by(dot: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_m: int,
                        block_n: int, act_rule: str) -> torch.Tensor:
    """`fp8_block_linear` through the named dot (one of `DOTS`); ``"fp8"`` needs DeepSeek's rule."""
    check_fp8_block(weight, scale, (block_m, block_n))
    check_act_rule(act_rule)
    if dot not in DOTS:
        raise ValueError(f"dot {dot!r} is not one of {DOTS}")
    if dot == "fp8" and act_rule != "deepseek":
        raise ValueError(f"the fp8 dot multiplies activations quantized by DeepSeek's rule, not rule {act_rule!r}")
    n_out, n_in = weight.shape
    x2 = x.reshape(-1, n_in)
    if dot == "fp8":
        xa, x_scale = act_quant_codes(x2)
    else:
        xa = x_scale = _activations(x2, act_rule)  # the kernel reads no activation scales
    m = xa.shape[0]
    out = torch.empty((m, n_out), dtype=torch.float32, device=x.device)
    ue8m0 = scale.dtype == torch.float8_e8m0fnu
    if m and n_out:
        s = scale.view(torch.uint8) if ue8m0 else scale
        _fp8_linear_kernel[(triton.cdiv(m, BM), triton.cdiv(n_out, BN))](
            xa, x_scale, weight.contiguous().view(torch.uint8), s.contiguous(), out, m, n_out, n_in, scale.shape[1],
            x_scale.shape[1], BLOCK_ROWS=block_m, BLOCK_COLS=block_n, SCALE_UE8M0=ue8m0, DOT=dot,
            ACT_GROUP=ACT_GROUP, BM=BM, BN=BN, BK=BK)
    return out.view(*x.shape[:-1], n_out)


@triton.jit
def _dense_linear_kernel(x, w, out, m, n_out, n_in, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows, cols, row_ok, col_ok = _output_tile(m, n_out, BM, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, n_in, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < n_in
        xt = tl.load(x + rows[:, None].to(tl.int64) * n_in + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w + cols[:, None].to(tl.int64) * n_in + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot(acc, xt, wt, False)
    tl.store(out + rows[:, None].to(tl.int64) * n_out + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    n_out, n_in = weight.shape
    x2 = x.reshape(-1, n_in).to(torch.float32).contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n_out), dtype=torch.float32, device=x.device)
    if m and n_out:
        _dense_linear_kernel[(triton.cdiv(m, BM), triton.cdiv(n_out, BN))](
            x2, weight.to(torch.float32).contiguous(), out, m, n_out, n_in, BM=BM, BN=BN, BK=BK)
    return out.view(*x.shape[:-1], n_out)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_m: int, block_n: int,
                     act_rule: str) -> torch.Tensor:
    """The op on x's device by the dot `fp8_linear_dot` picks for it."""
    dot = fp8_linear_dot(_capability(x), act_rule, scale.dtype == torch.float8_e8m0fnu, x.dtype)
    return fp8_block_linear_by(dot, x, weight, scale, block_m, block_n, act_rule)


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
            DOT_BF16=x.is_cuda and _exact_in_bf16(act_rule, True, x.dtype), BM=BM, BN=BN, BK=BK)
    return out.view(*x.shape[:2], n_out)
