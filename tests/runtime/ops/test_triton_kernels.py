"""The Triton kernels of the op set write exactly the reference's bytes.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET before they are imported); with one they run on it. Either way every
result is compared with the torch reference computed on the CPU: bytes for everything
written to a cache or staging, and bit patterns (NaN payloads aside) for decoded floats.
"""

from __future__ import annotations

import warnings

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from b12x_toolchain.runtime.formats import codecs as formats  # noqa: E402
from b12x_toolchain.runtime.formats import dsv41, minifloat  # noqa: E402
from b12x_toolchain.runtime.formats.codecs import get_format  # noqa: E402
from b12x_toolchain.runtime.ops import opset as ops  # noqa: E402,F401  (references)
from b12x_toolchain.runtime.ops import triton_rows, triton_window  # noqa: E402
from b12x_toolchain.runtime.ops.triton_codecs import _swallowed, e2m1_code, e4m3_code  # noqa: E402
from benchmarks.kernel_cases import edge_rows, kv_rows, window_case  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REF = torch.ops.b12x_toolchain
FORMATS = ("dsv41_mxfp8", "dsv41_nvfp4", "dsv41_mxfp4", "ocp_mxfp8", "ocp_mxfp4", "bf16", "fp32")
# 64: the tiny recipe, 512: the full model, 96: not a power of two (padded tiles).
DIMS = (64, 512, 96)
# Every format at every dim above, plus the indexer's 128-dim MXFP4 keys.
FORMAT_DIMS = [(f, d) for f in FORMATS for d in DIMS] + [("dsv41_mxfp4", 128), ("ocp_mxfp4", 128)]
# (verify width 8 | draft width 7) x (rows 1 | 3) x (tiny: dim 64, page 16 | full: dim 512, page 64)
WINDOW_CASES = [(w, r, d, p) for w in (8, 7) for r in (1, 3) for d, p in ((64, 16), (512, 64))]


@pytest.fixture(autouse=True)
def _quiet_overflow():
    # Decoding random bytes overflows to inf in the interpreter's numpy, as intended.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def on_device(*tensors):
    """Copies on the kernel device (never the caller's tensors: on the CPU `.to` would alias)."""
    return [t.to(DEVICE, copy=True) for t in tensors]


def same_floats(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-identical, except that any NaN equals any NaN (payloads are not part of a format)."""
    got = got.cpu()
    nan = torch.isnan(want)
    return torch.equal(torch.isnan(got), nan) and torch.equal(
        torch.where(nan, 0, got.view(torch.int32)), torch.where(nan, 0, want.view(torch.int32)))


# ---------------------------------------------------------------- E4M3 on the bits


@triton.jit
def _e4m3_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, e4m3_code(bits, 0), mask=offs < n)


def test_e4m3_rounding_matches_the_cast_on_every_bf16_pattern_and_random_floats():
    gen = torch.Generator().manual_seed(0)
    every_bf16 = (torch.arange(65536, dtype=torch.int32) << 16)
    # Every E4M3 midpoint (ties) and its float32 neighbours, and random bit patterns.
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].sort().values
    mids = ((grid[1:] + grid[:-1]) / 2).view(torch.int32)
    near = torch.cat([mids - 1, mids, mids + 1])
    near = torch.cat([near, near | (1 << 31)])
    bits = torch.cat([every_bf16, near, torch.randint(-2**31, 2**31 - 1, (200_000,), dtype=torch.int32, generator=gen)])
    x = bits.view(torch.float32)
    bits, x = bits[~torch.isnan(x)], x[~torch.isnan(x)]  # NaN is written per block, not cast
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    (dev_bits,) = on_device(bits)
    out = torch.empty_like(dev_bits)
    _e4m3_kernel[(triton.cdiv(bits.numel(), 8192),)](dev_bits, out, bits.numel(), BLOCK=8192)
    mismatch = (out.cpu() != want).sum().item()
    assert mismatch == 0, f"{mismatch} of {bits.numel()} values round differently"


@triton.jit
def _e2m1_kernel(x_ptr, e_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(x_ptr + offs, mask=offs < n, other=0)
    e = tl.load(e_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, e2m1_code(bits, e), mask=offs < n)


def test_e2m1_rounding_on_the_bits_matches_the_reference_at_every_block_exponent():
    # MXFP4 elements: E2M1(x * 2^-e) with the sign bit of x. The reference scales in float
    # and compares against the midpoints; the kernel rounds the bits of x directly.
    gen = torch.Generator().manual_seed(1)
    every_bf16 = (torch.arange(65536, dtype=torch.int32) << 16)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 8.0]).view(torch.int32)
    near = torch.cat([mids - 1, mids, mids + 1])
    base = torch.cat([every_bf16, near, near | (1 << 31),
                      torch.randint(-2**31, 2**31 - 1, (50_000,), dtype=torch.int32, generator=gen)])
    base = base[~torch.isnan(base.view(torch.float32))]
    cases = []
    for e in (0, -1, 3, -20, 40, -127, 125):  # the clamp's ends included
        # Shift the midpoints to this block exponent: x = m * 2^e (exact while normal).
        moved = (near.view(torch.float32) * 2.0**e).view(torch.int32)
        bits = torch.cat([base, moved, moved | (1 << 31)])
        bits = bits[~torch.isnan(bits.view(torch.float32))]
        cases.append((bits, torch.full_like(bits, e)))
    bits = torch.cat([c[0] for c in cases])
    e = torch.cat([c[1] for c in cases])
    x = bits.view(torch.float32)
    inv = minifloat._pow2_table(torch.device("cpu"))[127 - e.long()]
    want = (minifloat._e2m1_codes(x * inv) | (torch.signbit(x).to(torch.uint8) << 3)).to(torch.int32)
    dev_bits, dev_e = on_device(bits, e)
    out = torch.empty_like(dev_bits)
    _e2m1_kernel[(triton.cdiv(bits.numel(), 8192),)](dev_bits, dev_e, out, bits.numel(), BLOCK=8192)
    mismatch = (out.cpu() != want).sum().item()
    assert mismatch == 0, f"{mismatch} of {bits.numel()} values round differently"


@triton.jit
def _swallowed_kernel(k_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    k = tl.load(k_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + offs, _swallowed(k), mask=offs < n)


def test_the_window_scales_few_ulp_table_is_the_references_at_every_exponent():
    # The kernel's closed form (by binade) against dsv41._swallowed, over every float32
    # exponent the window quotient max(amax, 1e-4) / 448 can have: 1e-4 / 448 = 1.87 * 2^-23
    # up to float32 max / 448 = 1.43 * 2^119.
    ks = torch.arange(-23, 120, dtype=torch.int32)
    (dev_k,) = on_device(ks)
    out = torch.empty_like(dev_k)
    _swallowed_kernel[(1,)](dev_k, out, ks.numel(), BLOCK=256)
    assert out.cpu().tolist() == [dsv41._swallowed(int(k)) for k in ks]


# ---------------------------------------------------------------- formats


def test_every_format_has_a_triton_codec_and_unknown_names_fail_like_the_reference():
    assert set(triton_rows.CODES) == set(formats.FORMATS)
    assert set(triton_window.FUSABLE) <= set(triton_rows.CODES)
    x = torch.zeros(1, 2, 64)
    staging = torch.zeros(1, 2, 66, dtype=torch.uint8)
    for call in (lambda: triton_rows.stage_rows(staging, x, "int3"),
                 lambda: triton_rows.read_rows(staging, 64, "int3"),
                 lambda: triton_rows.round_trip(x, "int3"),
                 lambda: triton_window.cache_append(staging, x, 0, "NHD", 16, "int3")):
        with pytest.raises(ValueError, match="unknown KV-cache format 'int3'"):
            call()


@pytest.mark.parametrize("fmt,dim", FORMAT_DIMS)
def test_encode_decode_round_trip_match_the_reference(fmt, dim):
    gen = torch.Generator().manual_seed(dim)
    x = torch.cat([edge_rows(dim), torch.randn(22, dim, generator=gen) * 50]).view(4, 8, dim)
    want = get_format(fmt).encode(x)
    staging = torch.full_like(want, 0xAB)
    dev_staging, dev_x, dev_want = on_device(staging, x, want)
    triton_rows.stage_rows(dev_staging, dev_x, fmt)
    assert torch.equal(dev_staging.cpu(), want)
    assert same_floats(triton_rows.read_rows(dev_want, dim, fmt), get_format(fmt).decode(want, dim))
    assert same_floats(triton_rows.round_trip(dev_x, fmt), REF.round_trip(x, fmt))


def test_the_edge_rows_exercise_the_special_cases():
    # Guards the equality above: the edge rows must actually produce the special bytes.
    enc = get_format("ocp_mxfp8").encode(edge_rows(64))
    assert (enc[3, 64:] == 0xFF).any() and (enc[3, :64] == 0x7F).any()  # NaN block
    assert (enc[0, :64] == 0x7E).any() and (enc[0, :64] == 0xFE).any()  # saturation both signs
    assert (enc[2, :64] == 0).all() and (enc[1, 64:] == 0).all()  # zero blocks, -0.0 included
    assert (enc[7, :64] == 0x7E).all()  # 1.9 * 2^k block maximum saturates
    enc = get_format("ocp_mxfp4").encode(edge_rows(64))  # [10, 32 nibble bytes + 2 scales]
    assert enc[3, 33] == 0xFF and (enc[3, 16:32] == 0).all()  # NaN block: 0xFF, nibbles 0
    nibbles = torch.stack((enc[:, :32] & 0xF, enc[:, :32] >> 4), -1).view(10, 64)
    assert (nibbles[0] == 0x7).any() and (nibbles[0] == 0xF).any()  # saturation both signs
    assert (nibbles[0] == 0x8).any()  # -0.0 in a live block keeps its sign
    assert (nibbles[7] == 0x7).all()  # 1.9 * 2^k: 7.6 * 2^e saturates to 6
    assert (enc[2] == 0).all()  # -0.0 blocks are zero blocks
    enc = get_format("dsv41_mxfp8").encode(edge_rows(64))
    assert enc[3, 65] != 0xFF and (enc[3, 32:64] == 0x7F).sum() == 1  # NaN: that element only
    assert enc[0, 64] == 247 and (enc[0, :32] == 0x7E).any()  # +-inf: float32 max's scale
    assert (enc[1, 64:] == 105).all() and (enc[2, :64] == 0x80).all()  # the 1e-4 floor; -0.0 kept
    assert (enc[9, 64:] == 121).all() and enc[9, 0] == enc[9, 32] == 0x7E  # one ulp above 7
    enc = get_format("dsv41_nvfp4").encode(edge_rows(64))  # [10, 32 nibble bytes + 4 scales]
    assert enc[3, 34] == 0x7F and (enc[3, 16:24] == 0x77).all()  # NaN block: the reference's 0x77
    assert (enc[1, 32:] == 0x01).all() and (enc[2, :32] == 0x88).all()  # the 2^-9 floor; -0.0 kept


# ---------------------------------------------------------------- window ops


def _window_args(case, *names):
    return on_device(*(case[n] for n in names))


@pytest.mark.parametrize("width,rows,dim,page", WINDOW_CASES)
def test_fused_and_unfused_window_kernels_write_the_reference_staging(width, rows, dim, page):
    case = window_case(torch.Generator().manual_seed(width * 100 + rows + dim), rows, width, dim, page)
    want = case["staging"].clone()
    REF.window_snapshot(case["ring"], want, case["row_ids"], case["positions"], 128, "NHD", page)
    REF.cache_append(want, case["kv"], 128, "NHD", page, "dsv41_mxfp8")
    ring, kv, row_ids, positions = _window_args(case, "ring", "kv", "row_ids", "positions")
    fused, unfused = on_device(case["staging"].clone(), case["staging"].clone())
    triton_window.window_snapshot_append(ring, fused, kv, row_ids, positions, 128, "NHD", page, "dsv41_mxfp8")
    triton_window.window_snapshot(ring, unfused, row_ids, positions, 128, "NHD", page)
    triton_window.cache_append(unfused, kv, 128, "NHD", page, "dsv41_mxfp8")
    assert torch.equal(fused.cpu(), want) and torch.equal(unfused.cpu(), want)
    assert torch.equal(ring.cpu(), case["ring"])  # the snapshot only reads the ring


@pytest.mark.parametrize("cap", (48, 100))
def test_a_history_longer_than_the_ring_wraps_it_as_often_as_the_reference(cap):
    # The snapshot kernel's one-wrap path holds only while history <= ring capacity.
    case = window_case(torch.Generator().manual_seed(cap), 3, 8, 64, 16)
    case["ring"] = case["ring"][:, :cap].contiguous()
    want = case["staging"].clone()
    REF.window_snapshot(case["ring"], want, case["row_ids"], case["positions"], 128, "NHD", 16)
    ring, staging, row_ids, positions = _window_args(case, "ring", "staging", "row_ids", "positions")
    triton_window.window_snapshot(ring, staging, row_ids, positions, 128, "NHD", 16)
    assert torch.equal(staging.cpu(), want)


@pytest.mark.parametrize("width,rows,dim,page", WINDOW_CASES)
def test_commit_and_window_read_match_the_reference(width, rows, dim, page):
    case = window_case(torch.Generator().manual_seed(7 + width + rows + dim), rows, width, dim, page)
    staging = torch.randint(0, 256, case["staging"].shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    want = case["ring"].clone()
    REF.window_commit(want, staging, case["row_ids"], case["positions"], case["accept_len"], 128, width)
    ring, dev_staging, row_ids, positions, accept = on_device(
        case["ring"], staging, case["row_ids"], case["positions"], case["accept_len"])
    triton_window.window_commit(ring, dev_staging, row_ids, positions, accept, 128, width)
    assert torch.equal(ring.cpu(), want)
    assert not torch.equal(want, case["ring"])  # something was committed
    tokens = 128 + width
    assert same_floats(triton_rows.window_read(dev_staging, tokens, dim, "dsv41_mxfp8"),
                       REF.window_read(staging, tokens, dim, "dsv41_mxfp8"))


@pytest.mark.parametrize("fmt", ("dsv41_nvfp4", "ocp_mxfp4", "fp32", "bf16"))
def test_window_kernels_for_the_other_formats(fmt):
    dim, width, rows, page = 64, 8, 3, 16
    case = window_case(torch.Generator().manual_seed(3), rows, width, dim, page, fmt=fmt)
    want = case["staging"].clone()
    REF.window_snapshot_append(case["ring"], want, case["kv"], case["row_ids"], case["positions"], 128, "NHD", page, fmt)
    ring, staging, kv, row_ids, positions = _window_args(case, "ring", "staging", "kv", "row_ids", "positions")
    triton_window.window_snapshot_append(ring, staging, kv, row_ids, positions, 128, "NHD", page, fmt)
    assert torch.equal(staging.cpu(), want)


# ---------------------------------------------------------------- generic row ops


@pytest.mark.parametrize("fmt", FORMATS + ("bytes",))
def test_write_rows_scatters_only_valid_rows(fmt):
    gen = torch.Generator().manual_seed(11)
    dim, rows, width = 64, 3, 8
    row_bytes = get_format("dsv41_mxfp8" if fmt == "bytes" else fmt).row_bytes(dim)
    cache = torch.randint(0, 256, (5, 32, row_bytes), dtype=torch.uint8, generator=gen)
    if fmt == "bytes":
        values = torch.randint(0, 256, (rows, width, row_bytes), dtype=torch.uint8, generator=gen)
    else:
        values = kv_rows(gen, rows, width, dim)
    row_ids = torch.tensor([4, 0, 2], dtype=torch.int32)
    index = torch.remainder(torch.tensor([[30], [3], [12]]) + torch.arange(width), 32)
    valid = torch.rand(rows, width, generator=gen) > 0.4
    want = cache.clone()
    REF.write_rows(want, values, row_ids, index, valid, fmt)
    got, *args = on_device(cache, values, row_ids, index, valid)
    triton_rows.write_rows(got, *args, fmt)
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(want, cache)


@pytest.mark.parametrize("fmt", FORMATS + ("bytes",))
@pytest.mark.parametrize("dim", (64, 96))
def test_write_slots_writes_the_reference_records(fmt, dim):
    # A paged cache of random bytes, 4 records a page; slots scattered over every page,
    # some tokens writing nothing (-1): the kernel's bytes are the reference's, all of them.
    gen = torch.Generator().manual_seed(13 + dim)
    rows, width, per_page, pages = 3, 8, 4, 9
    record_bytes = get_format("dsv41_mxfp8" if fmt == "bytes" else fmt).row_bytes(dim)
    cache = torch.randint(0, 256, (pages, per_page * record_bytes), dtype=torch.uint8, generator=gen)
    if fmt == "bytes":
        values = torch.randint(0, 256, (rows, width, record_bytes), dtype=torch.uint8, generator=gen)
    else:
        values = kv_rows(gen, rows, width, dim)
    slots = torch.randperm(pages * per_page, generator=gen)[: rows * width].view(rows, width)
    slots = torch.where(torch.rand(rows, width, generator=gen) > 0.3, slots, -1)
    want = cache.clone()
    REF.write_slots(want, values, slots, fmt)
    got, *args = on_device(cache, values, slots.to(torch.int32))
    triton_rows.write_slots(got, *args, fmt)
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(want, cache)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_rows_wraps_indices_like_the_reference(fmt):
    gen = torch.Generator().manual_seed(12)
    dim = 64
    cache = get_format(fmt).encode(torch.randn(5, 32, dim, generator=gen) * 4)
    row_ids = torch.tensor([1, 4], dtype=torch.int32)
    index = torch.tensor([[-3, -1, 0, 31, 32, 70], [5, 6, -40, 1, 2, 3]])  # negative and past the end
    want = REF.gather_rows(cache, row_ids, index, dim, fmt)
    got = triton_rows.gather_rows(*on_device(cache, row_ids, index), dim, fmt)
    assert same_floats(got, want)
