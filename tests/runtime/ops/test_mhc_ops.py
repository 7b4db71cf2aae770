"""hc_sinkhorn: bitwise the written-out Sinkhorn on the CPU; its Triton kernel agrees to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.ops.mhc_ops import sinkhorn_unfused
from b12x_toolchain.runtime.ops.opset import ops

SHAPES = [(1, 1, 4, 4), (3, 8, 4, 4), (2, 64, 4, 4), (5, 3, 3)]  # n = 3 pads to 4 in the kernel


def _logits(shape, seed, scale=4.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_reference_is_bitwise_the_written_out_loop(shape, iters):
    for seed in range(20):
        logits = _logits(shape, seed, scale=0.1 + seed)
        assert torch.equal(ops.hc_sinkhorn(logits, iters, 1e-6), sinkhorn_unfused(logits, iters, 1e-6))


def test_reference_leaves_its_input_alone_and_returns_fp32():
    logits = _logits((2, 4, 4), 0).to(torch.bfloat16)
    before = logits.clone()
    comb = ops.hc_sinkhorn(logits, 20, 1e-6)
    assert torch.equal(logits, before) and comb.dtype == torch.float32
    # The last step normalised the columns; every weight stays positive.
    assert torch.allclose(comb.sum(-2), torch.ones(2, 4), atol=1e-5) and bool((comb > 0).all())


def test_one_node_in_a_captured_graph():
    class Mix(torch.nn.Module):
        def forward(self, logits):
            return ops.hc_sinkhorn(logits, 20, 1e-6)

    graph = torch.export.export(Mix(), (torch.zeros(1, 8, 4, 4),)).graph
    calls = [n.target for n in graph.nodes if n.op == "call_function"]
    assert calls == [ops.hc_sinkhorn.default]


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_kernel_agrees_with_the_reference(shape):
    pytest.importorskip("triton")
    from b12x_toolchain.runtime.ops import triton_mhc

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU (conftest)
    for seed in range(3):
        logits = _logits(shape, seed)
        got = triton_mhc.hc_sinkhorn(logits.to(device, copy=True), 20, 1e-6).cpu()
        torch.testing.assert_close(got, ops.hc_sinkhorn(logits, 20, 1e-6), rtol=1e-5, atol=1e-6)
