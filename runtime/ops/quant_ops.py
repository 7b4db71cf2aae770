"""The op set's linears: float32 weights, block-scaled FP8 and grouped FP4 experts.

Every op returns float32 and computes a row the same way whatever the number of rows in
the call (fixed_order.py): a token's product does not depend on the pass or the batch.
`dense_linear` takes a float32 weight. The quantized ones take the weights as the
checkpoint stores them (formats/weight_formats.py); their CPU references decode exactly
and multiply in float32, as transformers computes on CPU for these checkpoints (it
dequantizes to float32 and runs `F.linear`); the Triton kernels (`triton_quant`) decode
tiles in registers and agree to float32 accumulation order.

The activation rule is an argument: ``"none"`` uses x as float32; ``"deepseek"`` first
quantizes x to E4M3 per token per 128 channels with a power-of-two scale
(`act_quant_e4m3`), as DeepSeek's reference does before every FP8/FP4 linear.

Weights are never decoded whole: the references decode at most `DECODE_CHUNK_ELEMENTS`
weights at a time (a chunk of output rows, rounded to whole scale blocks), so peak extra
memory is under 16 bytes per chunk element -- 64 MiB at the default, or one block row of
the weight if that is larger -- besides the float32 activations and the result.
"""

from __future__ import annotations

from typing import Callable

import torch

from b12x_toolchain.runtime.formats.weight_formats import (
    act_quant_e4m3,
    check_fp4,
    check_fp8_block,
    decode_fp4,
    decode_fp8_block,
)
from b12x_toolchain.runtime.ops.define import fake_for, reference_op
from b12x_toolchain.runtime.ops.fixed_order import linear_rows

ACT_RULES = ("none", "deepseek")
DECODE_CHUNK_ELEMENTS = 1 << 22
"""Weights decoded to float32 at a time by the references (16 MiB of float32)."""


def check_act_rule(act_rule: str) -> None:
    if act_rule not in ACT_RULES:
        raise ValueError(f"activation rule {act_rule!r} is not one of {ACT_RULES}")


def activations(x: torch.Tensor, act_rule: str) -> torch.Tensor:
    """float32 activations under the rule: x itself, or DeepSeek's E4M3 quantize-dequantize."""
    check_act_rule(act_rule)
    return act_quant_e4m3(x) if act_rule == "deepseek" else x.to(torch.float32)


def check_expert_ids(x: torch.Tensor, expert_ids: torch.Tensor) -> None:
    if x.dim() != 3 or tuple(expert_ids.shape) != tuple(x.shape[:2]):
        raise ValueError(f"expert inputs are x [T, K, in] with expert_ids [T, K], not x {list(x.shape)} "
                         f"and expert_ids {list(expert_ids.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids must be int32 or int64, not {expert_ids.dtype}")


def _check_in_features(x: torch.Tensor, n_in: int) -> None:
    if x.shape[-1] != n_in:
        raise ValueError(f"x has {x.shape[-1]} features but the weight takes {n_in}")


def _linear_by_row_chunks(x: torch.Tensor, decode_rows: Callable[[int, int], torch.Tensor], n_out: int,
                          n_in: int, align: int) -> torch.Tensor:
    """x [..., in] @ W.T, W [out, in] decoded `decode_rows(start, stop)` a chunk of rows at a time.

    Chunks start on multiples of `align` (a scale block's rows). One chunk is the whole
    weight for most layers of a tiny model. The chunks follow from the weight's shape alone,
    never from the number of rows, so a row's result does not depend on the call either.
    """
    rows = max(align, DECODE_CHUNK_ELEMENTS // max(n_in, 1) // align * align)
    if rows >= n_out:
        return linear_rows(x, decode_rows(0, n_out))
    out = x.new_empty((*x.shape[:-1], n_out))
    for start in range(0, n_out, rows):
        stop = min(start + rows, n_out)
        out[..., start:stop] = linear_rows(x, decode_rows(start, stop))
    return out


@reference_op()
def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 [..., out] = x [..., in] @ W.T for a float32 weight W [out, in]."""
    _check_in_features(x, weight.shape[1])
    return linear_rows(x.to(torch.float32), weight)


@reference_op()
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_m: int, block_n: int,
                     act_rule: str) -> torch.Tensor:
    """float32 [..., out] = act(x [..., in]) @ W.T, W the FP8 weight [out, in] in (block_m, block_n) blocks.

    W is decoded a chunk of rows at a time (at most `DECODE_CHUNK_ELEMENTS` weights, or one
    block row): extra memory stays under 64 MiB at the default whatever the layer's size.
    """
    check_fp8_block(weight, scale, (block_m, block_n))
    _check_in_features(x, weight.shape[1])
    xa = activations(x, act_rule)

    def decode_rows(start: int, stop: int) -> torch.Tensor:
        scales = scale[start // block_m : -(-stop // block_m)]
        return decode_fp8_block(weight[start:stop], scales, (block_m, block_n))

    return _linear_by_row_chunks(xa, decode_rows, weight.shape[0], weight.shape[1], block_m)


@reference_op()
def fp4_expert_linear(x: torch.Tensor, expert_ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      act_rule: str) -> torch.Tensor:
    """float32 [T, K, out]: out[t, k] = act(x[t, k]) @ W[expert_ids[t, k]].T, W packed FP4 [E, out, in/2].

    Only the experts the ids name are decoded, one at a time (in row chunks), and each
    multiplies all of its rows at once.
    """
    check_fp4(weight, scale)
    check_expert_ids(x, expert_ids)
    n_out, n_in = weight.shape[1], 2 * weight.shape[2]
    _check_in_features(x, n_in)
    xa = activations(x, act_rule).reshape(-1, n_in)
    ids = expert_ids.reshape(-1)
    out = xa.new_empty((ids.shape[0], n_out))
    for expert in torch.unique(ids).tolist():
        rows = (ids == expert).nonzero().squeeze(1)

        def decode_rows(start: int, stop: int, e: int = expert) -> torch.Tensor:
            return decode_fp4(weight[e, start:stop], scale[e, start:stop])

        out[rows] = _linear_by_row_chunks(xa[rows], decode_rows, n_out, n_in, 1)
    return out.view(*x.shape[:2], n_out)


@fake_for(dense_linear)
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@fake_for(fp8_block_linear)
def _(x, weight, scale, block_m, block_n, act_rule):
    check_fp8_block(weight, scale, (block_m, block_n))
    check_act_rule(act_rule)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


@fake_for(fp4_expert_linear)
def _(x, expert_ids, weight, scale, act_rule):
    check_fp4(weight, scale)
    check_act_rule(act_rule)
    return x.new_empty((*x.shape[:2], weight.shape[1]), dtype=torch.float32)


QUANT_OPS = ("dense_linear", "fp8_block_linear", "fp4_expert_linear")
