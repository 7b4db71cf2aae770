"""The V4.1 cache records are FlashInfer's bytes: compared with its own reference encoder.

The pinned flashinfer-python wheel is installed in the test environment (the Makefile puts
it there without its CUDA-only dependencies). Its pure-torch encoder
`pack_deepseek_v41_cache_reference` is loaded from the wheel's file by path, so FlashInfer's
package (and its GPU runtime) is never imported. The reference takes rows of 512 values;
records of fewer dims (the tiny recipe's 64) are compared against the reference's record of
the row zero-padded to 512, whose blocks are independent: the first dim/32 (window) or
dim/16 (compressed) blocks' bytes must be ours.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import pytest
import torch

from b12x_toolchain.runtime.formats import dsv41
from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.ops import opset as ops  # noqa: F401  (registers write_slots)

REFERENCE_FILE = "experimental/b12x/attention/_shared/mla/compressed_reference.py"
RECORDS = {"dsv41_mxfp8": ("swa", 528, 32, 1), "dsv41_nvfp4": ("indexed", 288, 16, 2)}
"""format -> (the reference's cache_kind, record bytes at 512 dims, block, elements per payload byte)."""


@pytest.fixture(scope="module")
def reference():
    spec = importlib.util.find_spec("flashinfer")  # finds the package without running it
    assert spec is not None, "flashinfer-python is not installed: `make setup` installs it"
    path = f"{spec.submodule_search_locations[0]}/{REFERENCE_FILE}"
    module_spec = importlib.util.spec_from_file_location("flashinfer_v41_reference", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    assert "flashinfer" not in sys.modules  # FlashInfer itself was never initialised
    return module.pack_deepseek_v41_cache_reference


def test_the_installed_flashinfer_is_the_pinned_one():
    assert importlib.metadata.version("flashinfer-python") == dsv41.FLASHINFER_PIN


def reference_records(reference, fmt: str, x: torch.Tensor) -> torch.Tensor:
    """The reference's records [rows, row_bytes(dim)] of x [rows, dim] (dim <= 512)."""
    kind, record_bytes, block, per_byte = RECORDS[fmt]
    rows, dim = x.shape
    padded = torch.zeros(rows, 512)
    padded[:, :dim] = x
    full = reference(padded, page_size=1, cache_kind=kind).view(-1, record_bytes)[:rows]
    payload = 512 // per_byte
    return torch.cat([full[:, : dim // per_byte], full[:, payload : payload + dim // block]], dim=1)


def mismatched_rows(reference, fmt: str, x: torch.Tensor) -> torch.Tensor:
    ours = get_format(fmt).encode(x)
    return (ours != reference_records(reference, fmt, x)).any(dim=1).nonzero().flatten()


def corner_rows(dim: int, block: int) -> torch.Tensor:
    """Rows whose blocks sit on every edge the two rules have, one edge per block."""
    gen = torch.Generator().manual_seed(7)
    blocks = []
    for k in range(-24, 24):
        for ulps in range(0, 14):  # block maxima at and a few ulps above 448 * 2^k and 6 * 2^k
            for top in (448 * 2.0**k, 6 * 2.0**k, 2.0**k):
                amax = (torch.tensor(top).view(torch.int32) + ulps).view(torch.float32)
                b = torch.rand(block, generator=gen) * 2 - 1
                b[int(torch.randint(block, (1,), generator=gen))] = amax
                blocks.append(b * amax / b.abs().max())
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].sort().values
    e4m3_mid = (grid[1:] + grid[:-1]) / 2  # every E4M3 midpoint, at scale 1 (amax 448)
    for start in range(0, e4m3_mid.numel(), block - 1):
        blocks.append(torch.cat([torch.tensor([448.0]), e4m3_mid[start : start + block - 1]]))
    e2m1_mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # at scale 1 (amax 6)
    for sign in (1.0, -1.0):
        blocks.append(torch.cat([torch.tensor([6.0]), sign * e2m1_mid, torch.zeros(block - 8)]))
    blocks += [torch.zeros(block), torch.full((block,), -0.0), torch.full((block,), 1e-30),
               torch.full((block,), -3e-45), torch.tensor([6.0, -0.0] * (block // 2))]
    blocks = [b[:block] if b.numel() >= block else torch.cat([b, torch.zeros(block - b.numel())]) for b in blocks]
    flat = torch.cat(blocks)
    flat = torch.cat([flat, torch.zeros(-flat.numel() % dim)])
    return flat.view(-1, dim)


def random_rows(dim: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    mags = torch.tensor([1e-7, 1e-4, 1e-2, 1.0, 7.0, 448.0, 3e4, 1e12, 1e30])
    x = torch.randn(len(mags) * 40, dim, generator=gen) * mags.repeat_interleave(40)[:, None]
    binades = torch.exp2(torch.randint(-60, 60, (120, dim), generator=gen).float()) * torch.randn(120, dim, generator=gen)
    return torch.cat([x, binades])


@pytest.mark.parametrize("dim", [512, 64])
@pytest.mark.parametrize("fmt", list(RECORDS))
def test_records_are_the_references_bytes(reference, fmt, dim):
    block = RECORDS[fmt][2]
    x = torch.cat([random_rows(dim), corner_rows(dim, block)])
    bad = mismatched_rows(reference, fmt, x)
    assert bad.numel() == 0, f"{bad.numel()} of {x.shape[0]} rows differ, first {bad[:5].tolist()}"


def test_infinities_match_in_the_compressed_record_where_the_reference_defines_them(reference):
    # The compressed rule is defined for +-inf (amax / 6 clamps at 448, inf / 448 saturates).
    x = torch.zeros(4, 64)
    x[0, 0], x[1, 3], x[2, 17], x[3, :2] = float("inf"), -float("inf"), float("inf"), torch.tensor([1.0, -float("inf")])
    assert mismatched_rows(reference, "dsv41_nvfp4", x).numel() == 0


def test_nan_blocks_of_the_compressed_record_are_the_references(reference):
    # A positive NaN in a block: the reference's amax is NaN, its scale byte E4M3 NaN (0x7F)
    # and every nibble 0x7 (bucketize puts NaN past every midpoint): ours are the same.
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    x[0, 5], x[1, 16], x[2, 63] = float("nan"), float("nan"), float("nan")
    assert mismatched_rows(reference, "dsv41_nvfp4", x).numel() == 0


def test_window_non_finite_blocks_follow_b12xs_rule_where_the_reference_is_undefined(reference):
    # The reference casts ceil(log2(inf or NaN)) to int32, which C leaves undefined (this
    # machine gives scale byte 0 for inf and 127 for NaN). b12x counts inf as float32 max
    # (scale byte 247, inf stays inf) and writes NaN as 0x7F beside the finite elements.
    fmt = get_format("dsv41_mxfp8")
    x = torch.zeros(2, 64)
    x[0, :3] = torch.tensor([float("inf"), -float("inf"), 3.0])
    x[1, :3] = torch.tensor([float("nan"), 1.0, -2.0])
    ours = fmt.encode(x)
    assert ours[0, 64:].tolist() == [247, 105] and ours[0, :3].tolist() == [0x7E, 0xFE, 0x00]
    assert ours[1, 64:].tolist() == [120, 105] and ours[1, :3].tolist() == [0x7F, 0x70, 0xF8]
    decoded = fmt.decode(ours, 64)
    assert decoded[0, :3].tolist() == [float("inf"), -float("inf"), 0.0]
    assert decoded[1, 0].isnan() and decoded[1, 1:3].tolist() == [1.0, -2.0]
    # Finite blocks of the same rows are still the reference's bytes.
    finite = reference_records(reference, "dsv41_mxfp8", x.nan_to_num(0.0, 0.0, 0.0))
    assert torch.equal(ours[:, 32:64], finite[:, 32:64]) and torch.equal(ours[:, 65], finite[:, 65])


@pytest.mark.parametrize("fmt,page_size", [("dsv41_mxfp8", 64), ("dsv41_nvfp4", 64), ("dsv41_nvfp4", 32)])
def test_whole_pages_written_through_write_slots_are_the_references_pages(reference, fmt, page_size):
    # 3 requests' entries scattered over the pages of a pool by a slot mapping, as the exported
    # graphs write them; the pool must equal the reference's pages of the same rows in slot order.
    kind, record_bytes, _, _ = RECORDS[fmt]
    gen = torch.Generator().manual_seed(11)
    pages = 320 // page_size + 1  # room for the 300 entries and some slots nothing maps
    slots = torch.randperm(pages * page_size, generator=gen)[: 3 * 100].view(3, 100)
    values = torch.randn(3, 100, 512, generator=gen) * torch.tensor([0.01, 1.0, 300.0])[:, None, None]
    pool = torch.zeros(pages, page_size * record_bytes, dtype=torch.uint8)
    torch.ops.b12x_toolchain.write_slots(pool, values, slots, fmt)
    in_slot_order = torch.zeros(pages * page_size, 512)
    in_slot_order[slots.flatten()] = values.flatten(0, 1)
    want = reference(in_slot_order, page_size=page_size, cache_kind=kind)
    written = torch.zeros(pages * page_size, dtype=torch.bool)
    written[slots.flatten()] = True
    per_record = pool.view(-1, record_bytes)
    assert torch.equal(per_record[written], want.view(-1, record_bytes)[written])
    assert (per_record[~written] == 0).all()  # slots nothing maps stay as they were


def test_a_floor_exponent_breaks_byte_equality(reference, monkeypatch):
    # The OCP rule, floor(log2 amax) - 8, swapped in for the window record's exponent: the
    # comparison above must catch it.
    def floor_exponent(amax):
        return torch.frexp(amax)[1].to(torch.int64) - 1 - 8

    x = random_rows(512)
    assert mismatched_rows(reference, "dsv41_mxfp8", x).numel() == 0
    monkeypatch.setattr(dsv41, "window_exponents", floor_exponent)
    assert mismatched_rows(reference, "dsv41_mxfp8", x).numel() > x.shape[0] // 2


def test_an_exact_ceiling_is_not_the_references_rule(reference, monkeypatch):
    # Taking the ceiling on the bits (as FlashInfer's CUDA writers do) differs from the
    # reference's float32 log2 exactly in the few-ulp blocks, which the corner rows hold.
    def exact_ceiling(amax):
        bits = (amax.clamp_min(1e-4) / 448).view(torch.int32).to(torch.int64)
        return (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int64)

    x = corner_rows(512, 32)
    monkeypatch.setattr(dsv41, "window_exponents", exact_ceiling)
    assert mismatched_rows(reference, "dsv41_mxfp8", x).numel() > 0


# ---------------------------------------------------------------- index keys
# FlashInfer 0.7.4 writes DeepSeek V4.1's MXFP4 index keys only in a CuTe kernel
# (dsa_indexer/mxfp4.py, `_Quantize`): scale = pow2_ceil_ue8m0(max(amax, 6 * 2^-126) * (1/6)),
# elements E2M1(v * ue8m0_to_output_scale(byte)). Its pure-torch replicas of those two
# intrinsics live in _lib/intrinsics.py, a module that imports CUTLASS; the two functions
# are taken from that file's syntax tree, so neither CUTLASS nor FlashInfer is imported.

INTRINSICS_FILE = "experimental/b12x/_lib/intrinsics.py"


@pytest.fixture(scope="module")
def key_rounding():
    import ast

    path = f"{importlib.util.find_spec('flashinfer').submodule_search_locations[0]}/{INTRINSICS_FILE}"
    tree = ast.parse(open(path).read())
    wanted = {"pow2_ceil_ue8m0_torch", "_ue8m0_output_scale_torch"}
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    assert {f.name for f in functions} == wanted, "FlashInfer's intrinsics file no longer has its torch replicas"
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=functions, type_ignores=[]), path, "exec"), namespace)
    return namespace["pow2_ceil_ue8m0_torch"], namespace["_ue8m0_output_scale_torch"]


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles of v: nearest, ties to the even code, saturating at 6, the sign bit of v
    (as `cvt.rn.satfinite.e2m1x2`), written as the V4.1 reference writes them."""
    boundaries = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    magnitude = v.abs()
    codes = torch.bucketize(magnitude, boundaries)
    codes += ((codes < 7) & (magnitude == boundaries[codes.clamp(max=6)]) & (codes % 2 == 1)).to(codes.dtype)
    return codes.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def flashinfer_index_keys(key_rounding, x: torch.Tensor) -> torch.Tensor:
    pow2_ceil, output_scale = key_rounding
    rows, dim = x.shape
    blocks = x.view(rows, dim // 32, 32)
    amax = blocks.abs().amax(-1).clamp_min(6 * 2.0**-126)
    _, scale_bytes = pow2_ceil(amax * torch.tensor(1 / 6, dtype=torch.float32))
    nibbles = e2m1_codes(blocks * output_scale(scale_bytes).unsqueeze(-1)).view(rows, dim)
    return torch.cat([nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scale_bytes], dim=1)


@pytest.mark.parametrize("dim", [128, 32])
def test_index_keys_are_flashinfers_indexer_bytes(key_rounding, dim):
    huge = torch.tensor([3.4028235e38, -3e38, 2.0**127, 1.0] * (dim // 4)).view(1, dim)
    x = torch.cat([random_rows(dim), corner_rows(dim, 32), huge])
    ours = get_format("dsv41_mxfp4").encode(x)
    bad = (ours != flashinfer_index_keys(key_rounding, x)).any(dim=1).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} of {x.shape[0]} rows differ, first {bad[:5].tolist()}"


def test_an_ocp_scale_is_not_flashinfers_index_key(key_rounding):
    # ocp_mxfp4 (floor(log2 amax) - 2) on the same rows: the comparison above must catch it.
    x = random_rows(128)
    ocp = get_format("ocp_mxfp4").encode(x)
    assert (ocp != flashinfer_index_keys(key_rounding, x)).any(dim=1).float().mean() > 0.5
