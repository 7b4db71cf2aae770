"""A row's result does not depend on the call around it (runtime/ops/fixed_order.py).

Per op: every row computed in calls of 1, 2, 3, 8 and 24 rows is bitwise what the call of
24 gives it, for float32 and the FP8/FP4 weight formats and the cache records' formats.
Attention also gets a query's keys at other offsets, among other masked keys, as decode,
verify and prefill hold them. The linears, attention and Sinkhorn are checked in the torch
references and in the Triton kernels (in Triton's interpreter here, without a GPU). The
passes themselves are compared end to end in tests/exporter/model/test_exact_decoding.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from b12x_toolchain.runtime.formats.codecs import FORMATS
from b12x_toolchain.runtime.formats.weight_formats import quantize_fp4
from b12x_toolchain.runtime.ops import fixed_order
from b12x_toolchain.runtime.ops.opset import ops
from benchmarks.kernel_cases import attention_args, blocks_args, fp8_linear_case, sparse_case, topk_args

COUNTS = (1, 2, 3, 8, 24)
ROWS = COUNTS[-1]


@pytest.fixture(params=["reference", "triton"])
def kernels(request):
    """The ops as the torch references serve them, or the Triton kernels CUDA tensors get."""
    if request.param == "reference":
        return ops
    pytest.importorskip("triton")
    from b12x_toolchain.runtime.ops import triton_mhc, triton_quant, triton_sparse

    return SimpleNamespace(dense_linear=triton_quant.dense_linear, fp8_block_linear=triton_quant.fp8_block_linear,
                           fp4_expert_linear=triton_quant.fp4_expert_linear, hc_sinkhorn=triton_mhc.hc_sinkhorn,
                           sparse_attention=triton_sparse.sparse_attention)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _assert_rows_invariant(call, args: dict, rows_first: tuple[str, ...]):
    """call(**args) over the first n rows of every argument in `rows_first` gives the whole
    call's rows, and so do the rows in another order (for the references: Triton's interpreter
    multiplies a tile with numpy, whose BLAS rounds a row by its place in the tile, which a
    GPU's matrix units do not)."""
    whole = call(**args)
    for n in COUNTS[:-1]:
        part = call(**{k: v[:n] if k in rows_first else v for k, v in args.items()})
        assert torch.equal(part, whole[:n]), f"a call of {n} rows rounds differently from one of {ROWS}"
    if not isinstance(call, torch._ops.OpOverloadPacket):
        return
    order = torch.randperm(ROWS, generator=_gen(1))  # other neighbours, other places
    shuffled = call(**{k: v[order] if k in rows_first else v for k, v in args.items()})
    assert torch.equal(shuffled, whole[order])


@pytest.mark.parametrize("width", [1, 7])  # decode's tokens per row, and more
@pytest.mark.parametrize("n_in,n_out", [(128, 512), (128, 64), (64, 143), (256, 8)])
def test_dense_linear(kernels, n_in, n_out, width):
    g = _gen()
    args = {"x": torch.randn(ROWS, width, n_in, generator=g), "weight": torch.randn(n_out, n_in, generator=g)}
    _assert_rows_invariant(kernels.dense_linear, args, ("x",))


# The activation rule quantizes each row by itself and the tiles do not follow it: Triton's
# interpreter (seconds a case) takes every block shape under one rule, the references both.
BLOCKS, RULES = [(128, 128), (32, 32), (1, 32)], ["none", "deepseek"]
FP8_CASES = [("reference", b, r) for b in BLOCKS for r in RULES] + [("triton", b, "deepseek") for b in BLOCKS] + \
    [("triton", BLOCKS[0], "none")]


@pytest.mark.parametrize("kernels,block,rule", FP8_CASES, indirect=["kernels"])
def test_fp8_block_linear(kernels, block, rule):
    x, weight, scale = fp8_linear_case(ROWS, 200, 256, block, "ue8m0")
    args = {"x": x[:, None, :], "weight": weight, "scale": scale, "block_m": block[0], "block_n": block[1],
            "act_rule": rule}
    _assert_rows_invariant(kernels.fp8_block_linear, args, ("x",))


@pytest.mark.parametrize("kernels,rule", [("reference", "none"), ("reference", "deepseek"), ("triton", "deepseek")],
                         indirect=["kernels"])
def test_fp4_expert_linear(kernels, rule):
    g = _gen()
    weight, scale = quantize_fp4(torch.randn(4, 96, 128, generator=g) * 0.05)
    args = {"x": torch.randn(ROWS, 2, 128, generator=g), "expert_ids": torch.randint(0, 4, (ROWS, 2), generator=g),
            "weight": weight, "scale": scale, "act_rule": rule}
    _assert_rows_invariant(kernels.fp4_expert_linear, args, ("x", "expert_ids"))


SPARSE_ROWS = ("q", "iq", "head_weights", "new_keys", "new_entries", "positions", "window", "window_visible",
               "block_table")


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("fmt", ["dsv41_nvfp4", "fp32"])
def test_sparse_ops(ratio, fmt):
    positions = torch.randint(0, 90, (ROWS,), generator=_gen(ratio)).tolist()
    case = sparse_case(_gen(), positions, 8, ratio, fmt=fmt, index_fmt="dsv41_mxfp4" if fmt != "fp32" else "fp32")

    def run(name, **rows):
        c = {**case, **rows}
        if name == "attention":
            return ops.sparse_attention(*attention_args(c, ops.indexer_topk(*topk_args(c))))
        if name == "window":
            return ops.sparse_attention(*attention_args(c, entries=False))
        if name == "all_entries":
            return ops.sparse_attention(*attention_args(c))
        return ops.candidate_blocks(*blocks_args(c)) if name == "blocks" else ops.indexer_topk(*topk_args(c))

    for name in ("topk", "blocks", "attention", "window", "all_entries"):
        _assert_rows_invariant(lambda **rows: run(name, **rows), {k: case[k] for k in SPARSE_ROWS}, SPARSE_ROWS)


@pytest.mark.parametrize("entries", [False, True])
def test_attention_sees_its_keys_alike_wherever_the_pass_holds_them(kernels, entries):
    """One query over the same visible keys, held as decode holds them (the keys alone), as
    verify does (a history, then eight rows) and as prefill does (more rows, masked ones among
    them): a pass's window is its rows' history, then its own rows, by position."""
    g = _gen(4)
    case = sparse_case(g, [40], 1, 2, fmt="fp32", index_fmt="fp32")
    keys, q = torch.randn(1, 128, 64, generator=g), case["q"]

    def attend(before: int, width: int, t: int):
        after = width - 1 - t  # the query's own row is its pass row t
        window = torch.cat([torch.randn(1, before, 64, generator=g), keys, torch.randn(1, after, 64, generator=g)], 1)
        visible = torch.zeros(1, width, window.shape[1], dtype=torch.bool)
        visible[0, t, before:before + 128] = True
        visible[0, t + 1:, before:] = True  # later queries of the pass see the rows after too
        visible[0, :t, :before + 1] = True  # and earlier ones the history before
        queries = torch.randn(1, width, *q.shape[2:], generator=g)
        queries[:, t] = q[:, 0]
        c = {**case, "q": queries, "window": window, "window_visible": visible,
             "positions": case["positions"] - t, "new_entries": case["new_entries"].expand(1, width, -1)}
        return kernels.sparse_attention(*attention_args(c, entries=entries))[0, t]

    decode = attend(0, 1, 0)
    assert torch.equal(attend(1, 8, 0), decode)  # verify's first row
    # A prefill chunk's first row, and (window only: this case's stored entries are not what
    # its pass rows would close, so a later row would see other entries) its fourth and a
    # later one, the window at other offsets of its blocks.
    assert torch.equal(attend(7, 64, 0), decode)
    if not entries:
        assert torch.equal(attend(7, 64, 3), decode)
        assert torch.equal(attend(30, 64, 21), decode)


def test_hc_sinkhorn(kernels):
    args = {"logits": torch.randn(ROWS, 5, 2, 2, generator=_gen()), "iters": 20, "eps": 1e-6}
    _assert_rows_invariant(kernels.hc_sinkhorn, args, ("logits",))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_cache_records(fmt):
    """A row's record bytes (what every cache writer stores) and what a read returns."""
    values = torch.randn(ROWS, 8, 64, generator=_gen()) * torch.logspace(-3, 2, 64)
    args = {"values": values, "fmt": fmt}
    _assert_rows_invariant(ops.round_trip, args, ("values",))
    staging = torch.zeros(ROWS, 8, FORMATS[fmt].row_bytes(64), dtype=torch.uint8)

    def staged(values, staging, fmt):
        ops.stage_rows(staging, values, fmt)
        return staging.clone()

    _assert_rows_invariant(staged, {**args, "staging": staging}, ("values", "staging"))


@pytest.mark.parametrize("name", ["sigmoid", "silu", "softplus"])
def test_activations_round_a_value_alike_wherever_it_sits(name):
    """torch's own round some values by their place in the tensor (a scalar path for the tail)."""
    fn = getattr(fixed_order, name)
    x = torch.randn(3000, generator=_gen()) * 8
    alone = torch.stack([fn(x[i:i + 1])[0] for i in range(0, 3000, 7)])
    assert torch.equal(fn(x)[::7], alone)
    torch.testing.assert_close(fn(x), getattr(torch.nn.functional, name)(x), rtol=1e-6, atol=1e-6)


def test_ordered_sum_ignores_zeros_wherever_they_sit():
    terms = torch.randn(50, generator=_gen()) * torch.logspace(-4, 4, 50)
    spread = torch.zeros(200)
    spread[torch.arange(50) * 3 + 17] = terms  # the same terms in order, among zeros
    assert torch.equal(fixed_order.ordered_sum(terms, 0), fixed_order.ordered_sum(spread, 0))
