"""The codecs' lookup tables: built once per device, exact, and never handed to a fake trace."""

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from b12x_toolchain.runtime.formats import minifloat


def test_tables_are_exact_and_built_once_per_device():
    table = minifloat._pow2_table(torch.device("cpu"))
    assert minifloat._pow2_table(torch.device("cpu")) is table  # the same tensor, not a new one per call
    assert table[:255].tolist() == [2.0 ** (i - 127) for i in range(255)] and torch.isnan(table[255])
    assert table[0].item() == 2.0 ** -127 and table[0].item() > 0  # the subnormal survives
    packed = torch.tensor([[0x7F, 0xF8]], dtype=torch.uint8)  # low nibble first: 0xF, 0x7, 0x8, 0xF
    values = minifloat._unpack_e2m1(packed, 4).flatten()
    assert values.tolist() == [-6.0, 6.0, -0.0, -6.0] and torch.signbit(values[2])
    assert minifloat._table("e2m1", torch.device("cpu")) is minifloat._table("e2m1", torch.device("cpu"))


def test_a_fake_trace_gets_its_own_table():
    real = minifloat._pow2_table(torch.device("cpu"))
    with FakeTensorMode():
        fake = minifloat._pow2_table(torch.device("cpu"))
    assert isinstance(fake, FakeTensor) and not isinstance(real, FakeTensor)
    assert minifloat._pow2_table(torch.device("cpu")) is real  # the fake one was not kept
