"""DeepSeek's activation rule as Triton kernels, bitwise `weight_formats.act_quant_e4m3`.

Per token and per 128 channels: scale ``2^ceil(log2(max(amax, 1e-4) / 448))``, elements
E4M3 of ``x / scale``, nearest even, saturating. Every rounding decision is made on the
float32 bits (`triton_codecs`), so the interpreter and a GPU give the reference's bits.

Two forms of the same result: `act_quant_values` writes ``code * scale`` in float32 (what
the bfloat16 and float32 dots multiply), `act_quant_codes` writes the E4M3 bytes and one
float32 scale per group (what the FP8 tensor-core dot multiplies, rescaling afterwards). A
group holding inf or NaN is NaN either way: NaN values, or a NaN scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from b12x_toolchain.runtime.formats.weight_formats import ACT_GROUP
from b12x_toolchain.runtime.ops.triton_codecs import _magnitude, e4m3_code, e4m3_value

TOK = 16  # tokens per program


@triton.jit
def _quantize_groups(x, r, c, rows, n):
    """(E4M3 codes [TOK, GROUP], scale exponents [TOK], groups holding inf or NaN [TOK]) of one tile."""
    live = (r < rows) & (c < n)
    bits = tl.load(x + r.to(tl.int64) * n + c, mask=live, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    mag, _ = _magnitude(bits)
    non_finite = tl.max(((bits & 0x7F800000) == 0x7F800000).to(tl.int32), axis=1) > 0
    amax = tl.max(mag, axis=1).to(tl.float32, bitcast=True)
    floor = tl.full(amax.shape, 0x38D1B717, tl.int32).to(tl.float32, bitcast=True)  # float32(1e-4)
    q = tl.math.div_rn(tl.maximum(amax, floor), tl.full(amax.shape, 448.0, tl.float32))
    qbits = q.to(tl.int32, bitcast=True)
    e = (qbits >> 23) - 127 + ((qbits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2 q), exact
    return e4m3_code(bits, e[:, None]), e, non_finite


@triton.jit
def _act_values_kernel(x, out, rows, n, TOK: tl.constexpr, GROUP: tl.constexpr):
    r = tl.program_id(0) * TOK + tl.arange(0, TOK)[:, None]
    c = tl.program_id(1) * GROUP + tl.arange(0, GROUP)[None, :]
    codes, e, non_finite = _quantize_groups(x, r, c, rows, n)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    y = e4m3_value(codes) * scale[:, None]
    tl.store(out + r.to(tl.int64) * n + c, tl.where(non_finite[:, None], float("nan"), y), mask=(r < rows) & (c < n))


@triton.jit
def _act_codes_kernel(x, codes_out, scales_out, rows, n, groups, TOK: tl.constexpr, GROUP: tl.constexpr):
    r = tl.program_id(0) * TOK + tl.arange(0, TOK)[:, None]
    c = tl.program_id(1) * GROUP + tl.arange(0, GROUP)[None, :]
    codes, e, non_finite = _quantize_groups(x, r, c, rows, n)
    tl.store(codes_out + r.to(tl.int64) * n + c, codes.to(tl.uint8), mask=(r < rows) & (c < n))
    scale = tl.where(non_finite, float("nan"), ((e + 127) << 23).to(tl.float32, bitcast=True))
    token = tl.program_id(0) * TOK + tl.arange(0, TOK)
    tl.store(scales_out + token.to(tl.int64) * groups + tl.program_id(1), scale, mask=token < rows)


def _grid(rows: int, n: int) -> tuple[int, int]:
    return triton.cdiv(rows, TOK), triton.cdiv(n, ACT_GROUP)


def act_quant_values(x2: torch.Tensor) -> torch.Tensor:
    """float32 [rows, n]: DeepSeek's rule applied to x2 [rows, n] and decoded again."""
    src = x2.contiguous()
    out = torch.empty(src.shape, dtype=torch.float32, device=src.device)
    if src.shape[0]:
        _act_values_kernel[_grid(*src.shape)](src, out, *src.shape, TOK=TOK, GROUP=ACT_GROUP)
    return out


def act_quant_codes(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 E4M3 codes [rows, n], float32 scales [rows, ceil(n / 128)]) of DeepSeek's rule on x2.

    ``code * scale`` (scale per 128 channels) is `act_quant_values` bit for bit; a group
    holding inf or NaN has the scale NaN.
    """
    src = x2.contiguous()
    rows, n = src.shape
    codes = torch.empty((rows, n), dtype=torch.uint8, device=src.device)
    scales = torch.empty((rows, triton.cdiv(n, ACT_GROUP)), dtype=torch.float32, device=src.device)
    if rows and n:
        _act_codes_kernel[_grid(rows, n)](src, codes, scales, rows, n, scales.shape[1], TOK=TOK, GROUP=ACT_GROUP)
    return codes, scales


def act_quant_e4m3(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's activation rule by the Triton kernel: float32, bitwise `weight_formats.act_quant_e4m3`."""
    return act_quant_values(x.reshape(-1, x.shape[-1])).view(x.shape)
