"""The op set's ops are plain dispatcher ops: a call reaches the reference with no Python layer in between."""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.ops import engram_ops, mhc_ops, opset, quant_ops, sparse_ops
from b12x_toolchain.runtime.ops.define import fake_for, reference_op
from b12x_toolchain.runtime.ops.opset import NAMESPACE, OPS


def test_no_custom_op_wrappers_sit_on_the_call_path():
    # custom_op registers Python kernels for Autograd and (mutating ops) ADInplaceOrView;
    # those layers cost tens of microseconds a call and do nothing for inference.
    for name in OPS:
        qualified = f"{NAMESPACE}::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeExplicitAutograd"), name
        for key in ("Autograd", "ADInplaceOrView"):
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key), (name, key)


def test_a_call_runs_the_reference_and_mutates_in_place():
    ring = torch.zeros(2, 4, 8, dtype=torch.uint8)
    values = torch.arange(2 * 2 * 2, dtype=torch.float32).view(2, 2, 2)
    want = ring.clone()
    args = (torch.tensor([1, 0], dtype=torch.int32), torch.tensor([[0, 3], [2, 1]]), torch.tensor([[True, False], [True, True]]))
    opset.write_rows(want, values, *args, "fp32")  # the reference, called directly
    torch.ops.b12x_toolchain.write_rows(ring, values, *args, "fp32")
    assert torch.equal(ring, want) and ring.any()


def test_schemas_are_the_ones_torch_infers_with_their_mutations():
    for name, op in OPS.items():
        reference = next(getattr(m, name) for m in (opset, sparse_ops, mhc_ops, quant_ops, engram_ops) if hasattr(m, name))
        assert str(op._schema) == f"{NAMESPACE}::{name}" + torch.library.infer_schema(
            reference, mutates_args=[a.name for a in op._schema.arguments if a.is_write]), name
    assert str(OPS["write_rows"]._schema).startswith(f"{NAMESPACE}::write_rows(Tensor(a0!) cache,")


def test_a_new_op_defines_with_its_fake_for_capture():
    @reference_op(mutates_args=("out",))
    def b12x_test_scale_into(out: torch.Tensor, x: torch.Tensor, factor: float) -> None:
        out.copy_(x * factor)

    @reference_op()
    def b12x_test_double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    fake_for(b12x_test_scale_into)(lambda out, x, factor: None)
    fake_for(b12x_test_double)(lambda x: torch.empty_like(x))
    ops = getattr(torch.ops, NAMESPACE)
    out = torch.zeros(3)
    ops.b12x_test_scale_into(out, torch.ones(3), 1.5)
    assert out.tolist() == [1.5, 1.5, 1.5]
    meta = ops.b12x_test_double(torch.empty(5, device="meta"))
    assert meta.device.type == "meta" and meta.shape == (5,)
