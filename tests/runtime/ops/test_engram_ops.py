"""Engram's ops: the hash against the written-out rule, the lookup against an independent decode, kernels bitwise.

The Triton kernels run on the GPU when there is one, else in Triton's interpreter on CPU
tensors (conftest sets TRITON_INTERPRET); the interpreter is slow, so their cases are small.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from b12x_toolchain.runtime.ops.opset import OPS, ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MULTIPLIERS = [76632096046245, 4839876093313, 35959672319349, 73987337458391]  # V4.1-Flash layer 1
PRIMES = [1009, 1013, 1019, 1021, 1031, 1033]  # orders 2, 3, 4 x 2 heads
PAD = 2
VOCAB = 99092


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(shape, seed, dead=0.15) -> torch.Tensor:
    gen = _gen(seed)
    ids = torch.randint(0, VOCAB, shape, generator=gen)
    return torch.where(torch.rand(shape, generator=gen) < dead, -1, ids)


def written_out_hash(ids, lookback, multipliers, primes, pad_id):
    """The rule in Python ints, token by token, slot by slot: the reference's independent oracle."""
    n = len(multipliers)
    heads = len(primes) // (n - 1)
    offsets = [sum(primes[:c]) for c in range(len(primes))]
    out = []
    for row_ids, row_back in zip(ids.tolist(), lookback.tolist()):
        seq = row_back + row_ids
        row = []
        for t in range(len(row_ids)):
            blocked, r, columns = False, 0, []
            for k in range(n):
                v = seq[t + n - 1 - k]
                blocked = blocked or v == -1
                r ^= (pad_id if blocked else v) * multipliers[k]
                if k:
                    columns += [r % primes[c] + offsets[c] for c in range((k - 1) * heads, k * heads)]
            row.append(columns)
        out.append(row)
    return torch.tensor(out, dtype=torch.int64).view(ids.shape[0], ids.shape[1], len(primes))


def _lookback_before(seq: torch.Tensor, start: int, width: int = 3) -> torch.Tensor:
    """The `width` ids before position `start` of a 1-d sequence, -1 before its start: [1, width]."""
    before = seq[max(0, start - width) : start]
    return torch.cat([torch.full((width - before.shape[0],), -1, dtype=torch.int64), before]).view(1, width)


def _hash(ids, lookback):
    return ops.engram_hash(ids, lookback, MULTIPLIERS, PRIMES, PAD)


# ---------------------------------------------------------------- hash


def test_hash_equals_the_rule_written_out_with_dead_tokens_and_pre_start_padding():
    ids = _ids((4, 11), 0)
    lookback = _ids((4, 3), 1, dead=0.3)
    lookback[0] = -1  # a sequence's first tokens: blocked from slot 1 on, and again at a dead token
    lookback[1, 0] = -1
    ids[2, 0] = -1  # a dead token pads itself and every older slot
    got = _hash(ids, lookback)
    assert got.dtype == torch.int64 and got.shape == (4, 11, 6)
    assert torch.equal(got, written_out_hash(ids, lookback, MULTIPLIERS, PRIMES, PAD))


def test_blocking_is_cumulative_before_the_sequence_start():
    ids = torch.tensor([[11, 12, 13, 14]])
    got = _hash(ids, torch.full((1, 3), -1))
    # Position 0 sees (11, pad, pad, pad), 1 sees (12, 11, pad, pad): the same as if the
    # pre-start slots held the pad id itself.
    assert torch.equal(got, written_out_hash(ids, torch.full((1, 3), PAD), MULTIPLIERS, PRIMES, PAD))
    dead_then_live = _hash(torch.tensor([[11, -1, 12]]), torch.tensor([[7, 8, 9]]))
    # Token 12's window is (12, dead, 11, 9): the dead slot pads 11 and 9 too.
    assert torch.equal(dead_then_live[0, 2], _hash(torch.tensor([[12]]), torch.tensor([[5, 6, -1]]))[0, 0])


def test_a_column_lies_in_its_primes_rows():
    got = _hash(_ids((2, 50), 2), _ids((2, 3), 3))
    offsets = torch.tensor([sum(PRIMES[:c]) for c in range(len(PRIMES))])
    assert bool(((got >= offsets) & (got < offsets + torch.tensor(PRIMES))).all())


@pytest.mark.parametrize("chunk", [1, 7, 8, 64, 333])
def test_a_sequence_hashes_the_same_in_chunks_as_in_one_call(chunk):
    seq = _ids((1000,), 4, dead=0.05)
    whole = _hash(seq.view(1, -1), torch.full((1, 3), -1))
    parts = [_hash(seq[start : start + chunk].view(1, -1), _lookback_before(seq, start))
             for start in range(0, seq.shape[0], chunk)]
    assert torch.equal(torch.cat(parts, dim=1), whole)


def test_a_verify_block_hashes_as_decoding_its_tokens_one_by_one():
    seq = _ids((40,), 5, dead=0.0)
    anchor = 32  # the block [anchor, d1..d7] = seq[32:40]
    block = _hash(seq[anchor:].view(1, -1), _lookback_before(seq, anchor))
    one_by_one = [_hash(seq[t : t + 1].view(1, 1), _lookback_before(seq, t)) for t in range(anchor, 40)]
    assert torch.equal(block, torch.cat(one_by_one, dim=1))


# ---------------------------------------------------------------- lookup


def fp8_table(rows: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E4M3 bytes (no NaN codes) and UE8M0 bytes 0..254 (no NaN scale): the extremes included."""
    gen = _gen(seed)
    codes = torch.randint(0, 256, (rows, dim), generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, 0x7E, codes)
    scales = torch.randint(0, 255, (rows, -(-dim // 32)), generator=gen, dtype=torch.int32)
    scales[0, 0], scales[-1, -1] = 0, 254
    return (codes.to(torch.uint8).view(torch.float8_e4m3fn),
            scales.to(torch.uint8).view(torch.float8_e8m0fnu))


def independent_decode(table: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 value x 2^(byte - 127), exact in float64, rounded once to float32 and then to bfloat16."""
    exponent = scale.view(torch.uint8).to(torch.float64) - 127
    value = table.to(torch.float64) * torch.exp2(exponent).repeat_interleave(32, dim=1)[:, : table.shape[1]]
    return value.to(torch.float32).to(torch.bfloat16)


def _row_ids(rows: int, shape, seed: int) -> torch.Tensor:
    ids = torch.randint(0, rows, shape, generator=_gen(seed))
    ids.view(-1)[:2] = torch.tensor([0, rows - 1])  # the first and the last row
    return ids


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def test_fp8_lookup_is_the_independent_decode_in_bfloat16():
    table, scale = fp8_table(50, 64, 6)
    row_ids = _row_ids(50, (2, 3, 4), 7)
    got = ops.engram_lookup(table, scale, row_ids)
    want = independent_decode(table, scale)[row_ids].reshape(2, 3, 4 * 64)
    assert _same_bytes(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_tables_come_back_as_stored(dtype):
    table = torch.randn(30, 40, generator=_gen(8)).to(dtype)
    row_ids = _row_ids(30, (5, 3), 9)
    got = ops.engram_lookup(table, None, row_ids)
    assert _same_bytes(got, torch.cat([table[row_ids[:, c]] for c in range(3)], dim=1))


# ---------------------------------------------------------------- fakes and refusals


def test_fakes_give_the_shapes_and_dtypes():
    with FakeTensorMode():
        hashed = ops.engram_hash(torch.empty(3, 5, dtype=torch.int64), torch.empty(3, 3, dtype=torch.int64),
                                 MULTIPLIERS, PRIMES, PAD)
        fp8 = ops.engram_lookup(torch.empty(100, 64, dtype=torch.float8_e4m3fn),
                                torch.empty(100, 2, dtype=torch.float8_e8m0fnu), torch.empty(7, 6, dtype=torch.int64))
        stored = ops.engram_lookup(torch.empty(100, 64), None, torch.empty(2, 7, 6, dtype=torch.int64))
    assert (hashed.shape, hashed.dtype) == ((3, 5, 6), torch.int64)
    assert (fp8.shape, fp8.dtype) == ((7, 6 * 64), torch.bfloat16)
    assert (stored.shape, stored.dtype) == ((2, 7, 6 * 64), torch.float32)


BAD_HASH = [
    (dict(ids=torch.zeros(2, 4, dtype=torch.int32)), "ids must be int64"),
    (dict(lookback=torch.zeros(2, 2, dtype=torch.int64)), r"lookback must be int64 \[rows, n-1\] = \[2, 3\]"),
    (dict(primes=PRIMES[:5]), "positive multiple of 3 moduli, not 5"),
    (dict(multipliers=MULTIPLIERS[:1]), "n >= 2, not 1"),
]


@pytest.mark.parametrize("override,message", BAD_HASH)
def test_bad_hash_inputs_are_refused_by_name(override, message):
    args = dict(ids=torch.zeros(2, 4, dtype=torch.int64), lookback=torch.zeros(2, 3, dtype=torch.int64),
                multipliers=MULTIPLIERS, primes=PRIMES, pad_id=PAD) | override
    with pytest.raises(ValueError, match=message):
        ops.engram_hash(**args)
    mode = FakeTensorMode()
    fake_args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with mode, pytest.raises(ValueError, match=message):
        ops.engram_hash(**fake_args)


BAD_LOOKUP = [
    (torch.zeros(4, 64, dtype=torch.float16), None, "not torch.float16"),
    (torch.zeros(4, 64, dtype=torch.float8_e4m3fn), None, "needs a float8_e8m0fnu scale"),
    (torch.zeros(4, 64, dtype=torch.float8_e4m3fn), torch.zeros(4, 3, dtype=torch.float8_e8m0fnu), r"scale of shape \[4, 2\]"),
    (torch.zeros(4, 64), torch.zeros(4, 2, dtype=torch.float8_e8m0fnu), "takes no scale"),
]


@pytest.mark.parametrize("table,scale,message", BAD_LOOKUP)
def test_bad_lookup_inputs_are_refused_by_name(table, scale, message):
    with pytest.raises(ValueError, match=message):
        ops.engram_lookup(table, scale, torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="row_ids must be int64"):
        ops.engram_lookup(torch.zeros(4, 64), None, torch.zeros(2, 3, dtype=torch.int32))


def test_the_ops_are_in_the_op_set():
    assert {"engram_hash", "engram_lookup"} <= set(OPS)


# ---------------------------------------------------------------- Triton kernels


@pytest.fixture(scope="module")
def triton_engram():
    pytest.importorskip("triton")
    from b12x_toolchain.runtime.ops import triton_engram

    return triton_engram


def _on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("rows,tokens", [(3, 150), (1, 1), (2, 0)])
def test_hash_kernel_is_the_reference_bitwise(triton_engram, rows, tokens):
    ids = _ids((rows, tokens), 10)
    lookback = _ids((rows, 3), 11, dead=0.3)
    lookback[0] = -1
    got = triton_engram.engram_hash(*_on_device(ids, lookback), MULTIPLIERS, PRIMES, PAD)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), _hash(ids, lookback))


def test_hash_kernel_takes_another_order_and_head_count(triton_engram):
    multipliers, primes = MULTIPLIERS[:3], [101, 103, 107, 109, 113, 127]  # n = 3: orders 2, 3 x 3 heads
    ids, lookback = _ids((2, 20), 12), _ids((2, 2), 13)
    got = triton_engram.engram_hash(*_on_device(ids, lookback), multipliers, primes, 5)
    assert torch.equal(got.cpu(), ops.engram_hash(ids, lookback, multipliers, primes, 5))


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")  # the interpreter's inf products
def test_fp8_lookup_kernel_is_the_reference_bytewise(triton_engram):
    table, scale = fp8_table(40, 96, 14)  # three scales a row; subnormal and huge products included
    row_ids = _row_ids(40, (4, 5), 15)
    got = triton_engram.engram_lookup(*_on_device(table, scale, row_ids))
    assert _same_bytes(got, ops.engram_lookup(table, scale, row_ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_lookup_kernel_is_the_reference_bytewise(triton_engram, dtype):
    table = torch.randn(30, 70, generator=_gen(16)).to(dtype)
    table[3, 5] = float("nan")  # copied as bits: any payload comes back as stored
    row_ids = _row_ids(30, (2, 3, 2), 17)
    got = triton_engram.engram_lookup(table.to(DEVICE), None, row_ids.to(DEVICE))
    assert _same_bytes(got, ops.engram_lookup(table, None, row_ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host table read from the GPU needs one")
def test_lookup_kernel_reads_a_pinned_host_table_and_refuses_a_pageable_one(triton_engram):
    table, scale = fp8_table(40, 64, 18)
    row_ids = _row_ids(40, (3, 4), 19).cuda()
    got = triton_engram.engram_lookup(table.pin_memory(), scale.pin_memory(), row_ids)
    assert got.is_cuda and _same_bytes(got, ops.engram_lookup(table, scale, row_ids.cpu()))
    with pytest.raises(ValueError, match="pageable host memory"):
        triton_engram.engram_lookup(table, scale, row_ids)
