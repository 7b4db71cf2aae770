"""The quantized linears: references equal F.linear over the decoded weights; kernels agree.

The Triton kernels run on the GPU when there is one, else in Triton's interpreter on CPU
tensors (conftest sets TRITON_INTERPRET). They differ from the reference only in the
order float32 sums are taken, so they are compared within twice the worst-case error of
a float32 dot product of K terms: |got - want| <= K * 2^-23 * (|x| @ |W|.T), elementwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from b12x_toolchain.runtime.formats.weight_formats import (
    act_quant_e4m3,
    decode_fp4,
    decode_fp8_block,
    quantize_fp4,
    ue8m0_from,
)
from b12x_toolchain.runtime.ops import quant_ops
from b12x_toolchain.runtime.ops.fixed_order import linear_rows
from b12x_toolchain.runtime.ops.opset import OPS, ops
from benchmarks.kernel_cases import FP8_LINEAR_CASES, accumulation_bound, fp8_linear_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RULES = ("none", "deepseek")
# (tokens, top-k, experts, out, in): in is a multiple of 32 (the format); ids repeat.
FP4_CASES = [(6, 3, 4, 70, 96), (1, 2, 8, 64, 64), (20, 2, 3, 40, 128)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp4_case(tokens, top_k, experts, n_out, n_in, seed=0):
    gen = _gen(seed)
    x = torch.randn(tokens, top_k, n_in, generator=gen)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    ids[0, :] = ids[-1, -1]  # a repeat whatever the draw
    weight, scale = quantize_fp4(torch.randn(experts, n_out, n_in, generator=gen) * 0.05)
    return x, ids, weight, scale


def _activation(x, rule):
    return act_quant_e4m3(x) if rule == "deepseek" else x.float()


def _assert_within_accumulation_order(got, want, xa, w):
    bound = accumulation_bound(xa, w)
    error = (got.cpu() - want).abs()
    assert bool((error <= bound).all()), f"max error {error.max().item():.3g}, bound there {bound.flatten()[error.argmax()]:.3g}"


# ---------------------------------------------------------------- references


@pytest.mark.parametrize("case", FP8_LINEAR_CASES)
@pytest.mark.parametrize("rule", RULES)
def test_fp8_reference_is_f_linear_over_the_decoded_weight(case, rule):
    x, weight, scale = fp8_linear_case(*case)
    block = case[3]
    got = ops.fp8_block_linear(x.view(1, *x.shape), weight, scale, *block, rule)
    xa, decoded = _activation(x, rule), decode_fp8_block(weight, scale, block)
    assert got.dtype == torch.float32 and got.shape == (1, case[0], case[1])
    assert torch.equal(got[0], linear_rows(xa, decoded))  # one chunk: the row-invariant product itself
    torch.testing.assert_close(got[0], F.linear(xa, decoded), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block", [(128, 128), (32, 32), (1, 32)])
def test_fp8_reference_in_row_chunks_stays_within_1e_6(monkeypatch, block):
    x, weight, scale = fp8_linear_case(7, 300, 256, block, "ue8m0")
    whole = ops.fp8_block_linear(x, weight, scale, *block, "none")
    monkeypatch.setattr(quant_ops, "DECODE_CHUNK_ELEMENTS", 256 * 40)  # chunks of 40 rows or one block row
    decoded = []

    def spy(w, s, b):
        decoded.append(w.shape[0])
        return decode_fp8_block(w, s, b)

    monkeypatch.setattr(quant_ops, "decode_fp8_block", spy)
    chunked = ops.fp8_block_linear(x, weight, scale, *block, "none")
    rows = max(block[0], 40 // block[0] * block[0])
    assert decoded == [rows] * (300 // rows) + ([300 % rows] if 300 % rows else [])
    scale_of = x.abs() @ decode_fp8_block(weight, scale, block).abs().T
    assert bool(((chunked - whole).abs() <= 1e-6 * scale_of).all())


@pytest.mark.parametrize("case", FP4_CASES)
@pytest.mark.parametrize("rule", RULES)
def test_fp4_reference_is_each_rows_expert_applied(case, rule):
    x, ids, weight, scale = _fp4_case(*case)
    got = ops.fp4_expert_linear(x, ids, weight, scale, rule)
    assert got.dtype == torch.float32 and got.shape == (*ids.shape, case[3])
    xa = _activation(x, rule)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            w = decode_fp4(weight[ids[t, k]], scale[ids[t, k]])
            want = F.linear(xa[t, k], w)
            assert bool(((got[t, k] - want).abs() <= 1e-6 * (xa[t, k].abs() @ w.abs().T)).all()), (t, k)


def test_fp4_reference_decodes_only_the_named_experts_one_at_a_time(monkeypatch):
    x, ids, weight, scale = _fp4_case(4, 2, 16, 40, 64)
    ids = torch.tensor([[3, 9], [9, 3], [12, 3], [3, 9]])
    decoded = []

    def spy(packed, s):
        decoded.append(tuple(packed.shape))
        return decode_fp4(packed, s)

    monkeypatch.setattr(quant_ops, "decode_fp4", spy)
    ops.fp4_expert_linear(x, ids, weight, scale, "none")
    assert decoded == [(40, 32)] * 3  # experts 3, 9 and 12, each [out, in/2] once


@pytest.mark.parametrize("op, args", [
    ("fp8_block_linear", lambda: (*fp8_linear_case(2, 32, 64, (32, 32), "ue8m0"), 32, 32)),
    ("fp4_expert_linear", lambda: _fp4_case(2, 1, 2, 32, 64)),
])
def test_an_unknown_activation_rule_is_refused_by_name(op, args):
    with pytest.raises(ValueError, match=r"activation rule 'e5m2' is not one of \('none', 'deepseek'\)"):
        getattr(ops, op)(*args(), "e5m2")


def test_mismatched_inputs_are_refused():
    x, weight, scale = fp8_linear_case(2, 32, 64, (32, 32), "ue8m0")
    with pytest.raises(ValueError, match="x has 63 features but the weight takes 64"):
        ops.fp8_block_linear(x[:, :63], weight, scale, 32, 32, "none")
    with pytest.raises(ValueError, match=r"FP8 block \(128, 32\) is not one of"):
        ops.fp8_block_linear(x, weight, scale, 128, 32, "none")
    x, ids, weight, scale = _fp4_case(2, 2, 2, 32, 64)
    with pytest.raises(ValueError, match=r"expert_ids \[2\]"):
        ops.fp4_expert_linear(x, ids[:, 0], weight, scale, "none")
    with pytest.raises(ValueError, match="expert_ids must be int32 or int64, not torch.float32"):
        ops.fp4_expert_linear(x, ids.float(), weight, scale, "none")


def test_fakes_give_float32_shapes_and_capture_as_one_node_each():
    x, weight, scale = fp8_linear_case(3, 40, 64, (32, 32), "ue8m0")
    xe, ids, w4, s4 = _fp4_case(3, 2, 4, 24, 64)
    meta = [t.to("meta") for t in (x, weight, scale, xe, ids, w4, s4)]
    y = ops.fp8_block_linear(meta[0].view(1, 3, 64), meta[1], meta[2], 32, 32, "deepseek")
    z = ops.fp4_expert_linear(*meta[3:], "none")
    assert (y.shape, y.dtype, z.shape, z.dtype) == ((1, 3, 40), torch.float32, (3, 2, 24), torch.float32)

    class Layer(torch.nn.Module):
        def forward(self, x, xe, ids):
            return ops.fp8_block_linear(x, weight, scale, 32, 32, "deepseek"), \
                ops.fp4_expert_linear(xe, ids, w4, s4, "none")

    graph = torch.export.export(Layer(), (x, xe, ids)).graph
    calls = [n.target for n in graph.nodes if n.op == "call_function"]
    assert calls == [OPS["fp8_block_linear"], OPS["fp4_expert_linear"]]


# ---------------------------------------------------------------- Triton kernels


try:
    from b12x_toolchain.runtime.ops import triton_act_quant, triton_quant
except ImportError:  # no Triton: the references above still run
    triton_act_quant = triton_quant = None
needs_triton = pytest.mark.skipif(triton_quant is None, reason="needs triton")
# The interpreter runs the FP8 dot; a GPU only from compute capability 8.9.
runs_fp8_dot = pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9),
                                  reason="the GPU has no FP8 tensor cores")


def _on_device(*tensors):
    return [t.to(DEVICE, copy=True) for t in tensors]


def _act_edge_rows():
    """Rows at mixed magnitudes with a zero group, a NaN and an inf, the last group partial."""
    x = torch.randn(21, 300, generator=_gen(3)) * torch.logspace(-6, 4, 300)
    x[1, :128] = 0.0
    x[2, 140] = float("nan")
    x[3, 299] = float("-inf")
    return x


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf input overflows in the interpreter's numpy, as intended
def test_act_quant_kernel_is_bitwise_the_reference():
    x = _act_edge_rows()
    for src in (x, x.to(torch.bfloat16)):
        got = triton_act_quant.act_quant_e4m3(*_on_device(src)).cpu()
        want = act_quant_e4m3(src)
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))


@needs_triton
@pytest.mark.parametrize("case", FP8_LINEAR_CASES)
@pytest.mark.parametrize("rule", RULES)
def test_fp8_kernel_agrees_with_the_reference(case, rule):
    x, weight, scale = fp8_linear_case(*case, seed=1)
    block = case[3]
    want = ops.fp8_block_linear(x, weight, scale, *block, rule)
    got = triton_quant.fp8_block_linear(*_on_device(x, weight, scale), *block, rule)
    assert got.dtype == torch.float32 and got.shape == want.shape
    _assert_within_accumulation_order(got, want, _activation(x, rule), decode_fp8_block(weight, scale, block))


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf input overflows in the interpreter's numpy, as intended
def test_act_quant_codes_times_their_scales_are_the_values_bitwise():
    x = _act_edge_rows()
    codes, scales = (t.cpu() for t in triton_act_quant.act_quant_codes(*_on_device(x)))
    assert codes.dtype == torch.uint8 and scales.shape == (21, 3)
    got = codes.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(128, dim=1)[:, :300]
    want = act_quant_e4m3(x)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))
    assert scales.isnan().nonzero().tolist() == [[2, 1], [3, 2]]  # the NaN's group and the inf's, no other


@needs_triton
@runs_fp8_dot
@pytest.mark.parametrize("case", FP8_LINEAR_CASES)
def test_fp8_dot_agrees_with_the_reference(case):
    # The E4M3 x E4M3 dot with per-step promotion, run wherever this test runs: every
    # block shape, both scale encodings, edges that split activation groups and K steps.
    x, weight, scale = fp8_linear_case(*case, seed=4)
    block = case[3]
    want = ops.fp8_block_linear(x, weight, scale, *block, "deepseek")
    got = triton_quant.fp8_block_linear_by("fp8", *_on_device(x, weight, scale), *block, "deepseek")
    assert got.dtype == torch.float32 and got.shape == want.shape
    _assert_within_accumulation_order(got, want, act_quant_e4m3(x), decode_fp8_block(weight, scale, block))


@needs_triton
@runs_fp8_dot
@pytest.mark.parametrize("encoding", ["ue8m0", "fp32"])
def test_fp8_dot_multiplies_every_finite_e4m3_code_exactly(encoding):
    # One-hot activations (1.0 is E4M3 256 times 2^-8) pick single weights: each output is
    # one product, so any code the dot widened wrongly would show. 0x7F and 0xFF are NaN.
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0
    weight = codes.to(torch.uint8).view(8, 32).view(torch.float8_e4m3fn)
    scale = torch.full((8, 1), 2.0**-3)
    scale = ue8m0_from(scale) if encoding == "ue8m0" else scale
    got = triton_quant.fp8_block_linear_by("fp8", *_on_device(torch.eye(32), weight, scale), 1, 32, "deepseek")
    assert torch.equal(got.cpu(), decode_fp8_block(weight, scale, (1, 32)).T)


@needs_triton
@runs_fp8_dot
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf input overflows in the interpreter's numpy, as intended
def test_fp8_dot_makes_rows_with_inf_or_nan_nan_as_the_reference_does():
    x, weight, scale = fp8_linear_case(4, 40, 300, (32, 32), "ue8m0", seed=5)
    x[1, 7], x[2, 290] = float("nan"), float("inf")
    want = ops.fp8_block_linear(x, weight, scale, 32, 32, "deepseek")
    got = triton_quant.fp8_block_linear_by("fp8", *_on_device(x, weight, scale), 32, 32, "deepseek").cpu()
    assert bool(want[1:3].isnan().all()) and bool(got[1:3].isnan().all())
    xa = act_quant_e4m3(x)
    keep = [0, 3]
    _assert_within_accumulation_order(got[keep], want[keep], xa[keep], decode_fp8_block(weight, scale, (32, 32)))


@needs_triton
def test_the_fp8_dot_needs_deepseek_activations_and_dots_are_named():
    x, weight, scale = fp8_linear_case(2, 32, 64, (32, 32), "ue8m0")
    with pytest.raises(ValueError, match="the fp8 dot multiplies activations quantized by DeepSeek's rule, not rule 'none'"):
        triton_quant.fp8_block_linear_by("fp8", x, weight, scale, 32, 32, "none")
    with pytest.raises(ValueError, match=r"dot 'fp16' is not one of \('fp8', 'bf16', 'fp32'\)"):
        triton_quant.fp8_block_linear_by("fp16", x, weight, scale, 32, 32, "deepseek")


BF16, F32 = torch.bfloat16, torch.float32


@needs_triton
@pytest.mark.parametrize("capability, rule, ue8m0, x_dtype, dot", [
    # Triton's interpreter: always float32.
    (None, "deepseek", True, F32, "fp32"), (None, "none", True, BF16, "fp32"),
    # FP8 tensor cores (Ada 8.9, Hopper 9.0, Blackwell 10.0, 12.0) under DeepSeek's rule, whatever the scales.
    ((8, 9), "deepseek", True, F32, "fp8"), ((8, 9), "deepseek", False, F32, "fp8"),
    ((9, 0), "deepseek", False, BF16, "fp8"), ((10, 0), "deepseek", True, BF16, "fp8"),
    ((12, 0), "deepseek", False, F32, "fp8"),
    # Without them (Ampere 8.0 and 8.6): bfloat16 where exact (UE8M0 scales), else float32.
    ((8, 0), "deepseek", True, F32, "bf16"), ((8, 6), "deepseek", False, F32, "fp32"),
    # Unquantized activations never take the FP8 dot: bfloat16 only for bfloat16 x and UE8M0 scales.
    ((9, 0), "none", True, BF16, "bf16"), ((9, 0), "none", True, F32, "fp32"),
    ((9, 0), "none", False, BF16, "fp32"), ((8, 0), "none", True, BF16, "bf16"),
])
def test_fp8_linear_dot_is_chosen_by_capability_rule_scales_and_dtype(capability, rule, ue8m0, x_dtype, dot):
    assert triton_quant.fp8_linear_dot(capability, rule, ue8m0, x_dtype) == dot


@needs_triton
def test_cpu_tensors_take_the_float32_dot():
    assert triton_quant._capability(torch.zeros(1)) is None
    with pytest.raises(ValueError, match="activation rule 'e5m2'"):
        triton_quant.fp8_linear_dot((9, 0), "e5m2", True, F32)


@needs_triton
@pytest.mark.parametrize("case", FP4_CASES)
@pytest.mark.parametrize("rule", RULES)
def test_fp4_kernel_agrees_with_the_reference(case, rule):
    x, ids, weight, scale = _fp4_case(*case, seed=2)
    want = ops.fp4_expert_linear(x, ids, weight, scale, rule)
    got = triton_quant.fp4_expert_linear(*_on_device(x, ids.int(), weight, scale), rule)
    assert got.dtype == torch.float32 and got.shape == want.shape
    xa = _activation(x, rule)
    for e in ids.unique().tolist():
        rows = ids == e
        _assert_within_accumulation_order(got.cpu()[rows], want[rows], xa[rows], decode_fp4(weight[e], scale[e]))


@needs_triton
def test_bfloat16_activations_agree():
    # On a GPU these take the bfloat16 dot (as DeepSeek-rule activations with UE8M0 weights
    # do where there is no FP8 MMA); in the interpreter every case takes the float32 one.
    x, weight, scale = fp8_linear_case(4, 64, 128, (32, 32), "ue8m0")
    x = x.to(torch.bfloat16)
    want = ops.fp8_block_linear(x, weight, scale, 32, 32, "none")
    got = triton_quant.fp8_block_linear(*_on_device(x, weight, scale), 32, 32, "none")
    _assert_within_accumulation_order(got, want, x.float(), decode_fp8_block(weight, scale, (32, 32)))


@needs_triton
def test_expert_tiles_cover_every_row_once_within_the_static_bound():
    ids = torch.tensor([5, 0, 5, 5, 2, 0, 5, 5, 5, 2, 5])
    t = triton_quant.expert_tiles(ids, 7, 4)
    assert t["order"].tolist() == [1, 5, 4, 9, 0, 2, 3, 6, 7, 8, 10]  # stable within an expert
    assert t["counts"].tolist() == [2, 0, 2, 0, 0, 7, 0] and t["row_start"].tolist() == [0, 2, 2, 4, 4, 4, 11]
    # Tiles of 4: expert 0 one, expert 2 one, expert 5 two; slots ceil(11 / 4) + min(7, 11) = 10.
    assert t["tile_expert"].tolist() == [0, 2, 5, 5] + [7] * 6
    assert t["tile_first"].tolist() == [0, 1, 1, 2, 2, 2, 4]


@needs_triton
@pytest.mark.parametrize("rule", RULES)
def test_no_tokens_give_empty_results(rule):
    x, weight, scale = fp8_linear_case(0, 40, 64, (32, 32), "ue8m0")
    xe, ids, w4, s4 = _fp4_case(1, 2, 3, 24, 64)
    xe, ids = xe[:0], ids[:0]
    for fp8 in (ops.fp8_block_linear, triton_quant.fp8_block_linear):
        assert fp8(x, weight, scale, 32, 32, rule).shape == (0, 40)
    for fp4 in (ops.fp4_expert_linear, triton_quant.fp4_expert_linear):
        assert fp4(xe, ids, w4, s4, rule).shape == (0, 2, 24)


# ---------------------------------------------------------------- gpu_check's FP8 linear rows


@needs_triton
@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU dry run of the rows")
def test_gpu_check_fp8_linear_rows_run_both_dots_and_can_fail(monkeypatch):
    from benchmarks import gpu_check

    spec = FP8_LINEAR_CASES[3]
    monkeypatch.setattr(gpu_check, "RESULTS", [])
    gpu_check.fp8_linears("cpu", specs=[spec])  # the launchers, in the interpreter
    name = "fp8 linear 1x64x96 32x32 fp32"
    assert [(c.name, c.ok) for c in gpu_check.RESULTS] == [(f"{name} fp8 dot", True), (f"{name} fp32 dot", True)]

    run = triton_quant.fp8_block_linear_by
    monkeypatch.setattr(triton_quant, "fp8_block_linear_by", lambda *args: run(*args) * (1 + 2.0**-10))
    monkeypatch.setattr(gpu_check, "RESULTS", [])
    gpu_check.fp8_linears("cpu", specs=[spec])
    assert [c.ok for c in gpu_check.RESULTS] == [False, False]
