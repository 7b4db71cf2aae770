"""Saving a pass skips torch's discarded canonical-form check, and the bytes do not change."""

import io

import torch

from b12x_toolchain.exporter.pipeline.package_writer import program_bytes
from b12x_toolchain.runtime.ops.opset import ops


class Small(torch.nn.Module):
    def forward(self, seq_len, row_ids, x):
        ops.set_seq_len(seq_len, row_ids, row_ids + 1)
        y = x
        for _ in range(3):  # a few nodes of each kind, so canonical order and names matter
            y = (y / (y.sum(dim=-1, keepdim=True) + 1e-6)).relu()
        return y * 2


def test_program_bytes_equal_torch_save_with_its_check():
    program = torch.export.export(Small(), (torch.zeros(4, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                            torch.rand(2, 8)))
    from torch._export.serde import serialize

    calls = []
    check = serialize.canonicalize

    def counted(*args, **kwargs):
        calls.append(1)
        return check(*args, **kwargs)

    serialize.canonicalize = counted
    try:
        plain = io.BytesIO()
        torch.export.save(program, plain)
        assert calls, "torch.export.save no longer runs its canonical-form check: the skip is obsolete"
        calls.clear()
        ours = program_bytes(program)
        assert not calls  # skipped while saving ...
        assert serialize.canonicalize is counted  # ... and put back afterwards
    finally:
        serialize.canonicalize = check
    assert ours == plain.getvalue()
