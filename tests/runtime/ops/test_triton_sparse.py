"""The Triton kernels of the sparse ops give the reference's results.

As in test_triton_kernels, the kernels run in Triton's interpreter on CPU tensors here
(conftest sets TRITON_INTERPRET first) and on the GPU where there is one; the reference
is `sparse_ops` on the CPU. The int32 index outputs must be identical; attention agrees
to 1e-5 (an online softmax sums in another order). Every cache in these cases is paged
(each row's entries in shuffled pages, `kernel_cases.page_case`) and holds 0xFF bytes (NaN
in every format) past each row's committed length and in every page no row owns, so
every comparison also shows that nothing past the length, and no wrong page, is read.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from b12x_toolchain.runtime.ops import (  # noqa: E402
    cuda_kernels,
    opset,  # noqa: F401  (registers the references)
    triton_indexer,
    triton_sparse,
)
from benchmarks.kernel_cases import SPARSE_BLOCK_SIZE as BLOCK_SIZE  # noqa: E402
from benchmarks.kernel_cases import SPARSE_BLOCKS as BLOCKS  # noqa: E402
from benchmarks.kernel_cases import SPARSE_CASES as CASES  # noqa: E402
from benchmarks.kernel_cases import (  # noqa: E402
    attention_args,
    blocks_args,
    page_case,
    small_sparse_case,
    sparse_case_id,
    topk_args,
)

pytestmark = pytest.mark.slow(minutes=0.3)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REF = torch.ops.b12x_toolchain
IDS = [sparse_case_id(c) for c in CASES]  # the cases: see kernel_cases.SPARSE_CASES


@pytest.fixture(autouse=True)
def _quiet_overflow():
    # Decoding 0xFF poison in masked-off lanes overflows in the interpreter's numpy.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _on_device(case):
    """Copies on the kernel device (never the caller's tensors: on the CPU `.to` would alias)."""
    return {k: v.to(DEVICE, copy=True) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def _dev(t):
    return None if t is None else t.to(DEVICE, copy=True)


def _topk(case, k, candidates=None):
    got = triton_indexer.indexer_topk(*topk_args(_on_device(case), _dev(candidates), BLOCK_SIZE, k)).cpu()
    return got, REF.indexer_topk(*topk_args(case, candidates, BLOCK_SIZE, k))


def _blocks(case):
    got = triton_indexer.candidate_blocks(*blocks_args(_on_device(case), BLOCK_SIZE, BLOCKS)).cpu()
    return got, REF.candidate_blocks(*blocks_args(case, BLOCK_SIZE, BLOCKS))


def _attention(case, indices, entries=True):
    got = triton_sparse.sparse_attention(*attention_args(_on_device(case), _dev(indices), entries)).cpu()
    return got, REF.sparse_attention(*attention_args(case, indices, entries))


def _live(case):
    """Entries each query may see: [R, T]."""
    T = case["iq"].shape[1]
    return (case["positions"].long()[:, None] + torch.arange(T) + 1) // case["ratio"]


# ---------------------------------------------------------------- indexer


@pytest.mark.parametrize("spec", CASES, ids=IDS)
def test_indexer_topk_and_candidate_blocks_are_the_reference(spec):
    case = small_sparse_case(spec)
    got, want = _topk(case, 5)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    # min(5, visible) ids, then -1 padding (every case has queries that see fewer than 5
    # or none, but ratio 2's, where every query sees at least 5)
    assert torch.equal((got >= 0).sum(-1), _live(case).clamp(max=5))
    blocks, want = _blocks(case)
    assert torch.equal(blocks, want)
    # The chosen blocks as candidates: the same choice, restricted to those blocks.
    got, want = _topk(case, 5, blocks)
    assert torch.equal(got, want)
    chosen_blocks = torch.where(got >= 0, got // BLOCK_SIZE, -2)
    assert ((chosen_blocks[..., None] == blocks[..., None, :]).any(-1) | (got < 0)).all()


def test_candidates_restrict_the_choice_and_pad_with_minus_one():
    case = small_sparse_case(CASES[0])
    candidates = torch.full((3, 8, 3), -1, dtype=torch.int32)
    candidates[..., 0], candidates[..., 1] = 1, 8  # entries 4..7 and 32..35
    got, want = _topk(case, 16, candidates)
    assert torch.equal(got, want)
    live = _live(case)
    for r in range(3):
        for t in range(8):
            expect = [j for j in (*range(4, 8), *range(32, 36)) if j < live[r, t]]
            assert got[r, t].tolist() == expect + [-1] * (16 - len(expect))


def test_exact_ties_go_to_the_earlier_entry_and_block():
    case = small_sparse_case(CASES[2], ties=True)  # every score is an exact 0 (ReLU)
    got, want = _topk(case, 5)
    assert torch.equal(got, want)
    live = _live(case)
    for r, t in ((0, 7), (2, 3)):
        assert got[r, t].tolist() == list(range(min(5, live[r, t]))) + [-1] * (5 - min(5, live[r, t]))
    blocks, want = _blocks(case)
    assert torch.equal(blocks, want)
    assert blocks[2, 0].tolist() == [0, 1, 2, 3]  # the first 3 of blocks 0..3, then the newest (entry 15's)


def test_exact_scores_with_many_ties_select_as_the_reference():
    # Grid-valued queries, weights and keys: every score is exact in any summation order,
    # so the choice is decided by the values and the tie rule alone, never by rounding.
    # Stored keys come in equal pairs: k = 5 splits a pair wherever the 3rd best is one.
    case = small_sparse_case((1, [20, 33, 2], 8, "dsv41_nvfp4", "ocp_mxfp4", 64), exact=True)
    got, want = _topk(case, 5)
    assert torch.equal(got, want)
    blocks, want = _blocks(case)
    assert torch.equal(blocks, want)


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("spec", CASES, ids=IDS)
def test_sparse_attention_is_the_reference(spec):
    case = small_sparse_case(spec)
    indices = REF.indexer_topk(*topk_args(case, None, BLOCK_SIZE, 5))  # -1 padded where fewer are live
    for chosen in (indices, None):
        got, want = _attention(case, chosen)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_window_only_attention_and_a_query_that_sees_nothing():
    case = small_sparse_case(CASES[1])
    case["window_visible"][0, 0] = False  # sees no window row, and no entries: the sink takes all
    got, want = _attention(case, None, entries=False)
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))  # exact: nothing is ever added
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- lengths, not capacity


def test_bytes_past_the_length_the_page_layout_and_the_capacity_change_no_bit():
    # NaN bytes past the length in one run; finite bytes there, other pages for the same
    # entries and block tables twice as wide (twice the capacity), in the other: every
    # output bit for bit the same, attention included.
    poisoned = small_sparse_case(CASES[2])
    other = dict(poisoned)
    gen = torch.Generator().manual_seed(3)
    for name in ("index_records", "entry_records"):
        records = poisoned[name].clone()
        for r, committed in enumerate(poisoned["committed"]):
            stale = records[r, committed:]  # finite bytes (below 0x7F) instead of NaN
            stale.copy_(torch.randint(0, 0x7F, stale.shape, dtype=torch.uint8, generator=gen))
        other[name] = records
    other = page_case(other, gen, width=2 * poisoned["block_table"].shape[1])
    assert not torch.equal(other["block_table"][:, :2], poisoned["block_table"][:, :2])
    indices = REF.indexer_topk(*topk_args(poisoned, None, BLOCK_SIZE, 5))
    runs = []
    for case in (poisoned, other):
        dev = _on_device(case)
        runs.append((triton_indexer.indexer_topk(*topk_args(dev, None, BLOCK_SIZE, 5)).cpu(),
                     triton_indexer.candidate_blocks(*blocks_args(dev, BLOCK_SIZE, BLOCKS)).cpu(),
                     triton_sparse.sparse_attention(*attention_args(dev, _dev(indices))).cpu(),
                     triton_sparse.sparse_attention(*attention_args(dev, None)).cpu()))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert torch.equal(runs[0][0], indices) and not torch.isnan(runs[0][3]).any()


# ---------------------------------------------------------------- dispatch


def test_the_sparse_ops_dispatch_to_these_kernels_on_cuda_only():
    kernels = {"indexer_topk": triton_indexer.indexer_topk, "candidate_blocks": triton_indexer.candidate_blocks,
               "sparse_attention": triton_sparse.sparse_attention}
    for name, kernel in kernels.items():
        assert cuda_kernels.KERNELS[name] is kernel
        assert cuda_kernels.backend_for(name, "cuda") == "triton"
        assert cuda_kernels.backend_for(name, "cpu") == "reference"


def test_the_launchers_never_sync_with_the_host():
    # A CUDA graph cannot capture a host sync; these are the ways a launcher would make one.
    syncing = re.compile(r"\.item\(|\.tolist\(|\.nonzero\(|\.cpu\(|\bbool\(|\bint\(.*\]|torch\.unique|\.any\(\)|\.all\(\)")
    for module in (triton_indexer, triton_sparse):
        offenders = [line for line in Path(module.__file__).read_text().splitlines() if syncing.search(line)]
        assert offenders == [], module.__name__


# ---------------------------------------------------------------- gpu_check's sparse rows


def test_gpu_check_sparse_rows_run_and_can_fail(monkeypatch):
    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_check, "RESULTS", [])
    gpu_check.sparse_kernels(DEVICE, specs=[CASES[1]], extras=False)  # the launchers (in the interpreter without a GPU)
    assert [(c.name, c.ok) for c in gpu_check.RESULTS] == [(f"sparse ops {IDS[1]}", True)]

    class Wrong:  # the reference, off by one id / by 1e-3: every row must say so
        @staticmethod
        def indexer_topk(*args):
            return REF.indexer_topk(*args) + 1

        @staticmethod
        def candidate_blocks(*args):
            return REF.candidate_blocks(*args).flip(-1)

        @staticmethod
        def sparse_attention(*args):
            return REF.sparse_attention(*args) + 1e-3

    problems = gpu_check.compare_sparse(Wrong, small_sparse_case(CASES[1]), DEVICE, BLOCK_SIZE, BLOCKS, 5)
    assert [p.split(":")[0] for p in problems] == ["topk", "blocks", "topk in blocks", "attention top-k", "attention all"]


def test_gpu_check_length_cases_have_the_full_shapes_and_agree_with_themselves(monkeypatch):
    from benchmarks import gpu_check

    monkeypatch.setattr(gpu_check, "SPARSE_LENGTHS", (16, 64))  # a small capacity: the CPU side only
    case = gpu_check.sparse_length_case(16, exact=True)
    assert case["q"].shape == (gpu_check.SPARSE_ROWS, 8, 64, 512)
    assert case["block_table"].shape[1] * case["page_entries"] == 64 + 64  # the capacity, in whole pages
    assert case["iq"].shape[-2:] == (32, 64) and case["positions"].tolist() == [16] * gpu_check.SPARSE_ROWS
    assert gpu_check.compare_sparse(REF, case, "cpu", gpu_check.SPARSE_FULL_BLOCK, 4, 8) == []
