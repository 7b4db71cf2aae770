"""GPU qualification of the CUDA path, in one command on one CUDA device:

    python benchmarks/gpu_check.py [--json PATH] [--packages DIR] [--quick]

It needs the `cuda` extra (torch with CUDA, triton) and takes a few minutes. It prints a
line per check as it goes and a table last; the exit status is 0 only if every check
passed. Checks, for the tiny recipe and the full-size window writer shapes:

* kernel bytes: the CUDA kernels (through the op dispatcher) against the torch reference
  on the CPU, on random rows and the edge vectors, with poisoned staging: fused and
  unfused window writers at verify width 8 / draft width 7, rows 1 and 3, dims 64 and 512;
  the commit into the persistent ring; the other row writers and readers;
* fused vs unfused sessions of the tiny recipe on CUDA: staging and persistent cache
  bytes and logits identical after draft -> verify -> commit steps with every reusable
  buffer poisoned before each replay, rows 1 and 3;
* CUDA vs CPU sessions from the same cache bytes and page tables: the history snapshot in
  staging is identical (the appended rows come from float math that legitimately differs);
* `torch.cuda.memory_allocated` unchanged over 100 replays;
* kernel nodes of every captured graph, counted through the CUDA graph API: the fused
  graph has exactly one fewer per fused window layer;
* graph replays per second, fused vs unfused: fused at least as fast;
* fused writer bandwidth at least 70% of a device-to-device copy of the same bytes;
* sparse ops (`indexer_topk`, `candidate_blocks`, `sparse_attention`) against the CPU
  reference on the test suite's cases (`kernel_cases.SPARSE_CASES`, paged caches in
  shuffled pages, poisoned past the committed length): index outputs identical, attention
  within 1e-5; then at committed lengths 1k / 4k / 16k in one capacity (block tables for
  16k + 64 entries, 64 per page): identical again (scores built exact, so rounding cannot
  decide a choice), and each op captured in a CUDA graph (no host sync) and timed at the
  full model's shapes, where time must follow the length;
* `fp8_block_linear` under DeepSeek's activation rule on the test suite's cases
  (`kernel_cases.FP8_LINEAR_CASES`) and the full model's q_a projection: the FP8
  tensor-core dot (compute capability 8.9 and up) and the dot taken without it, each
  within the tests' accumulation-order bound of the CPU reference (the detail gives the
  worst element's share of its bound), the dispatched op equal to the chosen dot, and
  the full-size cases timed by dot in CUDA graphs.

Every timed kernel also gets a roofline: the bytes it must move and the FLOPs it must do
(`kernel_cases`' work functions), the card's peaks (`PEAKS`; an unknown card's bandwidth is
measured) and the floor time they give, printed as floor / measured.

`--packages DIR` loads packages exported elsewhere with the runtime alone (a row says no
exporter module was imported): the GPU machine's torch may be one that cannot export.
`--device cpu` runs what it can on the CPU (kernels in Triton's interpreter, sessions
without capture); it checks this script, and proves nothing about a GPU. `--quick` takes one
case of each kernel group. `--json` is rewritten after every part, so a run stopped by a
timeout keeps the parts it finished.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REPLAYS = 100
BANDWIDTH_ROWS = 4096  # full-size staging rows for the bandwidth comparison (~290 MB written)
LAUNCHES_PER_GRAPH = 10
MIN_BANDWIDTH_RATIO = 0.70
PROMPT_LENGTHS = (200, 37, 129, 1)


@dataclass
class Check:
    name: str
    ok: bool | None  # None: informational
    detail: str
    roofline: dict | None = None  # a timed kernel: its floor time against the measured one (`roofline`)


RESULTS: list[Check] = []


def record(name: str, ok: bool | None, detail: str, roofline: dict | None = None) -> None:
    RESULTS.append(Check(name, ok, detail, roofline))
    mark = {True: "PASS", False: "FAIL", None: "info"}[ok]
    floor = f" [{roofline['fraction']:.0%} of the roofline floor]" if roofline else ""
    print(f"[{mark}] {name}: {detail}{floor}", flush=True)


# ---------------------------------------------------------------- kernel bytes


# Window writer cases (width, rows, dim, page size) and row-op records (format, dim); --quick
# (a dry run of the script) takes one of each: three rows (a padded bucket), the first format.
WINDOW_CASES = [(w, r, d, p) for w in (8, 7) for r in (1, 3) for d, p in ((64, 16), (512, 64))]
QUICK_WINDOW_CASES = [(8, 3, 64, 16)]
ROW_FORMATS = [("dsv41_mxfp8", 64), ("dsv41_mxfp8", 512), ("dsv41_nvfp4", 64), ("dsv41_nvfp4", 512), ("dsv41_mxfp4", 32),
               ("dsv41_mxfp4", 128), ("ocp_mxfp8", 512), ("ocp_mxfp4", 128), ("fp32", 128)]


def kernel_bytes(device: str, quick: bool = False) -> None:
    import torch

    from b12x_toolchain.runtime.formats.codecs import get_format
    from b12x_toolchain.runtime.ops import triton_rows, triton_window
    from benchmarks.kernel_cases import kv_rows, window_case

    R = torch.ops.b12x_toolchain
    # On CUDA the ops go through the dispatcher (which must pick the Triton kernels); on
    # the CPU dry run the launchers are called directly, in the interpreter.
    win = triton_window if device == "cpu" else R
    rows_ops = triton_rows if device == "cpu" else R

    for width, rows, dim, page in QUICK_WINDOW_CASES if quick else WINDOW_CASES:
        name = f"kernel bytes w{width} r{rows} d{dim}"
        case = window_case(torch.Generator().manual_seed(width * 1000 + rows * 10 + dim), rows, width, dim, page)
        ref = case["staging"].clone()
        R.window_snapshot_append(case["ring"], ref, case["kv"], case["row_ids"], case["positions"], 128, "NHD", page, "dsv41_mxfp8")
        ref_unfused = case["staging"].clone()
        R.window_snapshot(case["ring"], ref_unfused, case["row_ids"], case["positions"], 128, "NHD", page)
        R.cache_append(ref_unfused, case["kv"], 128, "NHD", page, "dsv41_mxfp8")
        g = {k: v.to(device) for k, v in case.items()}
        fused, unfused = g["staging"].clone(), g["staging"].clone()
        win.window_snapshot_append(g["ring"], fused, g["kv"], g["row_ids"], g["positions"], 128, "NHD", page, "dsv41_mxfp8")
        win.window_snapshot(g["ring"], unfused, g["row_ids"], g["positions"], 128, "NHD", page)
        win.cache_append(unfused, g["kv"], 128, "NHD", page, "dsv41_mxfp8")
        ring_ref = case["ring"].clone()
        R.window_commit(ring_ref, ref, case["row_ids"], case["positions"], case["accept_len"], 128, width)
        win.window_commit(g["ring"], fused, g["row_ids"], g["positions"], g["accept_len"], 128, width)
        ok = {
            "fused staging = CPU": torch.equal(fused.cpu(), ref),
            "unfused staging = CPU": torch.equal(unfused.cpu(), ref),
            "CPU fused = CPU unfused": torch.equal(ref, ref_unfused),
            "persistent ring = CPU": torch.equal(g["ring"].cpu(), ring_ref),
        }
        record(name, all(ok.values()), ", ".join(k for k, v in ok.items() if not v) or "staging and ring identical")

    # Every V4.1 record at the tiny and full recipes' dims (CUDA bytes = the CPU reference, which
    # tests/runtime/formats/test_flashinfer_records.py holds to FlashInfer's encoder), plus OCP.
    for fmt, dim in ROW_FORMATS[:1] if quick else ROW_FORMATS:
        gen = torch.Generator().manual_seed(dim)
        values = kv_rows(gen, 3, 8, dim)
        nbytes = get_format(fmt).row_bytes(dim)
        staged = torch.full((3, 8, nbytes), 0xFF, dtype=torch.uint8)
        R.stage_rows(staged, values, fmt)
        got = torch.full_like(staged, 0xFF).to(device)
        rows_ops.stage_rows(got, values.to(device), fmt)
        cache = torch.randint(0, 256, (5, 16, nbytes), dtype=torch.uint8, generator=gen)
        idx = torch.remainder(torch.tensor([[9], [0], [14]]) + torch.arange(8), 16)
        valid = torch.rand(3, 8, generator=gen) > 0.3
        ids = torch.tensor([4, 1, 2], dtype=torch.int32)
        want = cache.clone()
        R.write_rows(want, staged, ids, idx, valid, "bytes")
        dev_cache = cache.to(device)
        rows_ops.write_rows(dev_cache, staged.to(device), ids.to(device), idx.to(device), valid.to(device), "bytes")
        # write_slots: the same rows encoded into scattered records of a paged cache (4 per page).
        pages = torch.randint(0, 256, (7, 4 * nbytes), dtype=torch.uint8, generator=gen)
        slots = torch.where(valid, torch.randperm(28, generator=gen)[:24].view(3, 8), -1)
        paged = pages.clone()
        R.write_slots(paged, values, slots, fmt)
        dev_pages = pages.to(device)
        rows_ops.write_slots(dev_pages, values.to(device), slots.to(device), fmt)
        dec = rows_ops.read_rows(staged.to(device), dim, fmt).cpu()
        dec_ref = R.read_rows(staged, dim, fmt)
        same_dec = torch.equal(torch.isnan(dec), torch.isnan(dec_ref)) and torch.equal(
            torch.nan_to_num(dec, nan=0.0).view(torch.int32), torch.nan_to_num(dec_ref, nan=0.0).view(torch.int32))
        ok = (torch.equal(got.cpu(), staged) and torch.equal(dev_cache.cpu(), want) and same_dec
              and torch.equal(dev_pages.cpu(), paged))
        record(f"row ops {fmt} d{dim}", ok,
               "stage_rows, write_rows(bytes), write_slots, read_rows identical" if ok else "mismatch")


# ---------------------------------------------------------------- sparse ops

SPARSE_LENGTHS = (1024, 4096, 16384)  # committed entries per row in the timing rows
SPARSE_ROWS = 4
# The full model's indexer and attention (recipes/dsv41.yaml); candidate blocks of 8.
SPARSE_FULL = dict(dim=512, heads=64, index_dim=128, index_heads=32, fmt="dsv41_nvfp4", index_fmt="dsv41_mxfp4")
SPARSE_TOPK, SPARSE_FULL_BLOCK, SPARSE_FULL_BLOCKS = 512, 8, 256
SPARSE_PAGE_ENTRIES = 64  # entries per cache page in the length cases


def _sparse_calls(block_size: int, blocks: int, topk: int) -> dict:
    """name -> (op name, arguments builder taking (case, earlier results)) of every sparse op checked."""
    from benchmarks.kernel_cases import attention_args, blocks_args, topk_args

    return {
        "topk": ("indexer_topk", lambda c, got: topk_args(c, None, block_size, topk)),
        "blocks": ("candidate_blocks", lambda c, got: blocks_args(c, block_size, blocks)),
        "topk in blocks": ("indexer_topk", lambda c, got: topk_args(c, got["blocks"], block_size, topk)),
        "attention top-k": ("sparse_attention", lambda c, got: attention_args(c, got["topk"])),
        "attention all": ("sparse_attention", lambda c, got: attention_args(c, None)),
    }


def compare_sparse(ops, case: dict, device: str, block_size: int, blocks: int, topk: int) -> list[str]:
    """Every sparse op through `ops` on `device` against the reference on the CPU: what differs.

    Each op gets the reference's earlier results (top-k ids, candidate blocks) as inputs,
    so one wrong op is reported once.
    """
    import torch

    ref = torch.ops.b12x_toolchain
    dev = {k: v.to(device, copy=True) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    want, problems = {}, []
    for name, (op, args) in _sparse_calls(block_size, blocks, topk).items():
        want[name] = getattr(ref, op)(*args(case, want))
        got = getattr(ops, op)(*args(dev, {k: v.to(device) for k, v in want.items()})).cpu()
        if op == "sparse_attention":
            if not torch.allclose(got, want[name], rtol=1e-5, atol=1e-6):
                problems.append(f"{name}: max error {(got - want[name]).abs().max().item():.2e}")
        elif not torch.equal(got, want[name]):
            problems.append(f"{name}: {(got != want[name]).any(-1).sum().item()} queries differ")
    return problems


def sparse_kernels(device: str, specs=None, extras: bool = True) -> None:
    import torch

    from b12x_toolchain.runtime.ops import triton_indexer, triton_sparse
    from benchmarks.kernel_cases import (
        SPARSE_BLOCK_SIZE,
        SPARSE_BLOCKS,
        SPARSE_CASES,
        small_sparse_case,
        sparse_case_id,
    )

    # On CUDA through the dispatcher; on the CPU dry run the launchers, in the interpreter.
    class Launchers:
        indexer_topk = staticmethod(triton_indexer.indexer_topk)
        candidate_blocks = staticmethod(triton_indexer.candidate_blocks)
        sparse_attention = staticmethod(triton_sparse.sparse_attention)

    ops = Launchers if device == "cpu" else torch.ops.b12x_toolchain
    cases = [(sparse_case_id(spec), small_sparse_case(spec)) for spec in specs or SPARSE_CASES]
    if extras:
        cases += [("all scores tied", small_sparse_case(SPARSE_CASES[2], ties=True)),
                  ("exact scores", small_sparse_case((1, [20, 33, 2], 8, "dsv41_nvfp4", "dsv41_mxfp4", 64), exact=True))]
    for name, case in cases:
        problems = compare_sparse(ops, case, device, SPARSE_BLOCK_SIZE, SPARSE_BLOCKS, 5)
        record(f"sparse ops {name}", not problems,
               "; ".join(problems) or "top-k, blocks, top-k in blocks identical; attention within 1e-5")


def mhc_kernel(device: str, quick: bool = False) -> None:
    """hc_sinkhorn's kernel against the CPU reference (float32 rounding, not bitwise)."""
    import torch

    from b12x_toolchain.runtime.ops import triton_mhc
    from b12x_toolchain.runtime.ops.opset import ops as R

    # On CUDA through the dispatcher; on the CPU dry run the launcher, in the interpreter.
    kernel = triton_mhc.hc_sinkhorn if device == "cpu" else R.hc_sinkhorn
    for shape in ((1, 1, 4, 4), (4, 8, 4, 4), (8, 64, 4, 4))[: 1 if quick else 3]:
        logits = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4
        got = kernel(logits.to(device, copy=True), 20, 1e-6).cpu()
        error = (got - R.hc_sinkhorn(logits, 20, 1e-6)).abs().max().item()
        record(f"mhc hc_sinkhorn {'x'.join(map(str, shape))}", error <= 1e-5, f"max error {error:.2e} (bound 1e-5)")


def engram_kernels(device: str) -> None:
    """engram_hash and engram_lookup against the CPU references, bit for bit; on CUDA also a
    pinned host table read in place from inside a captured CUDA graph."""
    import torch

    from b12x_toolchain.runtime.formats.weight_formats import quantize_fp8_block
    from b12x_toolchain.runtime.ops import triton_engram
    from b12x_toolchain.runtime.ops.opset import ops as R

    hashing = triton_engram.engram_hash if device == "cpu" else R.engram_hash
    lookup = triton_engram.engram_lookup if device == "cpu" else R.engram_lookup
    gen = torch.Generator().manual_seed(0)
    multipliers, primes = [76632096046245, 4839876093313, 35959672319349, 73987337458391], [1009, 1013, 1019] * 2
    ids, lookback = torch.randint(-1, 99092, (2, 16), generator=gen), torch.randint(-1, 99092, (2, 3), generator=gen)
    row_ids = R.engram_hash(ids, lookback, multipliers, primes, 2)
    got = hashing(ids.to(device, copy=True), lookback.to(device, copy=True), multipliers, primes, 2).cpu()
    record("engram hash 2x16, 3 orders x 2 heads", torch.equal(got, row_ids), "int64 row ids equal the reference")
    table, scale = quantize_fp8_block(torch.randn(sum(primes), 64, generator=gen), (1, 32), "ue8m0")
    want = R.engram_lookup(table, scale, row_ids)
    rows = row_ids.to(device, copy=True)
    got = lookup(table.to(device, copy=True), scale.to(device, copy=True), rows).cpu()
    record("engram lookup FP8 1x32 -> bf16", torch.equal(got.view(torch.int16), want.view(torch.int16)),
           "bytes equal the reference")
    if device != "cuda":
        return
    host = (table.pin_memory(), scale.pin_memory())
    graph, out = torch.cuda.CUDAGraph(), None
    lookup(*host, rows)  # compiled before capture
    with torch.cuda.graph(graph):
        out = lookup(*host, rows)
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))
    record("engram lookup, pinned host table in a CUDA graph", same, "rows read in place from host memory equal the reference")


# ---------------------------------------------------------------- roofline

# The datasheets' peak rates of known cards, by a fragment of the device name (first match
# wins, so the H100's PCIe and NVL forms come before the SXM's plain "H100"): HBM bytes/s and
# dense bf16 / fp8 tensor-core FLOP/s. An unknown card's bandwidth is measured (a device
# copy, bytes read plus written) and its FLOPs bound nothing.
PEAKS = (
    ("H100 PCIe", {"bytes": 2.0e12, "bf16": 756e12, "fp8": 1513e12}),
    ("H100 NVL", {"bytes": 3.9e12, "bf16": 835e12, "fp8": 1671e12}),
    ("H200", {"bytes": 4.8e12, "bf16": 989e12, "fp8": 1979e12}),
    ("H100", {"bytes": 3.35e12, "bf16": 989e12, "fp8": 1979e12}),
)
COPY_BYTES = 1 << 30  # the unknown card's bandwidth probe
_card: dict = {}


def peaks_for(name: str) -> dict | None:
    return next((dict(rates, card=fragment) for fragment, rates in PEAKS if fragment in name), None)


def card_peaks() -> dict:
    """This run's card's peaks (measured once when the card is not in PEAKS)."""
    import torch

    if not _card:
        name = torch.cuda.get_device_name()
        _card.update(peaks_for(name) or {"bytes": copy_bandwidth(), "bf16": None, "fp8": None,
                                         "card": f"{name}: bandwidth measured"})
    return _card


def copy_bandwidth() -> float:
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / _graph_seconds(lambda: dst.copy_(src))


def roofline(seconds: float, work: dict, peaks: dict) -> dict:
    """A timed kernel against its floor: the longer of moving its bytes at the card's bandwidth
    and doing its FLOPs at the card's dot rate; `fraction` = floor / measured (1 = at the roof)."""
    memory = work["bytes"] / peaks["bytes"]
    rate = peaks.get(work["dot"])
    compute = work["flops"] / rate if rate and work["flops"] else 0.0
    floor = max(memory, compute)
    return {"seconds": seconds, **work, "floor_seconds": floor, "fraction": floor / seconds,
            "bound": "compute" if compute > memory else "memory", "peaks": peaks["card"]}


def roofline_table() -> str:
    rows = [c for c in RESULTS if c.roofline]
    if not rows:
        return ""
    width = max(len(c.name) for c in rows)
    lines = [f"{'kernel':<{width}}  measured  bytes      FLOPs      floor     floor/measured  bound",
             f"{'-' * width}  --------  ---------  ---------  --------  --------------  -------"]
    for c in rows:
        r = c.roofline
        lines.append(f"{c.name:<{width}}  {r['seconds'] * 1e6:>6.1f}us  {r['bytes']:>9.3g}  {r['flops']:>9.3g}  "
                     f"{r['floor_seconds'] * 1e6:>6.2f}us  {r['fraction']:>14.1%}  {r['bound']}")
    return "\n".join(lines) + f"\npeaks: {rows[0].roofline['peaks']}"


def sparse_length_case(committed: int, exact: bool, device: str = "cpu") -> dict:
    """SPARSE_ROWS rows at ratio 1 that have each committed `committed` entries, in paged
    caches whose block tables address one capacity for every length; `exact`: index dim 64
    with grid-valued scores."""
    import torch

    from benchmarks.kernel_cases import sparse_case

    shape = dict(SPARSE_FULL, index_dim=64) if exact else SPARSE_FULL
    return sparse_case(torch.Generator().manual_seed(committed), [committed] * SPARSE_ROWS, 8, 1,
                       capacity=max(SPARSE_LENGTHS) + 64, page_entries=SPARSE_PAGE_ENTRIES, exact=exact,
                       device=device, **shape)


def _graph_seconds(fn, rounds: int = 10) -> float:
    """Median seconds per call of `fn` replayed in a CUDA graph of LAUNCHES_PER_GRAPH calls."""
    import torch

    graph = _graph_of(fn, LAUNCHES_PER_GRAPH)
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0 / LAUNCHES_PER_GRAPH)
    return statistics.median(times)


def sparse_timing() -> None:
    import torch

    from benchmarks.kernel_cases import sparse_work

    ops = torch.ops.b12x_toolchain
    seconds: dict[str, dict[int, float]] = {}
    for committed in SPARSE_LENGTHS:
        label = f"{committed // 1024}k"
        problems = compare_sparse(ops, sparse_length_case(committed, exact=True), "cuda", SPARSE_FULL_BLOCK,
                                  SPARSE_FULL_BLOCKS, SPARSE_TOPK)
        record(f"sparse ops = CPU at {label} committed", not problems,
               "; ".join(problems) or "index outputs identical, attention within 1e-5")
        case = sparse_length_case(committed, exact=False, device="cuda")
        got: dict = {}
        for name, (op, args) in _sparse_calls(SPARSE_FULL_BLOCK, SPARSE_FULL_BLOCKS, SPARSE_TOPK).items():
            call_args = args(case, got)
            got[name] = getattr(ops, op)(*call_args)
            try:
                t = _graph_seconds(lambda: getattr(ops, op)(*call_args))
            except Exception as exc:  # a host sync makes capture fail: that is the finding
                record(f"sparse time {name} {label}", False, f"not capturable in a CUDA graph: {exc}")
                continue
            seconds.setdefault(name, {})[committed] = t
            need = sparse_work(name, committed, SPARSE_ROWS, 8, **SPARSE_FULL, topk=SPARSE_TOPK,
                               block_size=SPARSE_FULL_BLOCK, blocks=SPARSE_FULL_BLOCKS)
            record(f"sparse time {name} {label}", True, f"{t * 1e6:,.1f} us per call, captured in a CUDA graph",
                   roofline(t, need, card_peaks()))
    short, long = min(SPARSE_LENGTHS), max(SPARSE_LENGTHS)
    for name, by_length in seconds.items():
        if short in by_length and long in by_length:
            growth = by_length[long] / by_length[short]
            # Attention over listed ids reads SPARSE_TOPK entries at any length: informational.
            record(f"sparse cost follows length: {name}", None if name == "attention top-k" else growth > 2.0,
                   f"{long // 1024}k / {short // 1024}k committed: {growth:.1f}x the time, same capacity")


# ---------------------------------------------------------------- quantized linears


def fp8_linears(device: str, specs=None) -> None:
    """`fp8_block_linear` under DeepSeek's activation rule against the CPU reference, by each
    dot: the FP8 tensor-core one where the device has FP8 MMA, and the one taken without.

    Each must stay within the accumulation-order bound of the tests (the detail says how
    much of it the worst element uses); on CUDA the op through the dispatcher must equal
    the dot `fp8_linear_dot` picks, and the full-size cases are timed by dot.
    """
    import torch

    from b12x_toolchain.runtime.formats.weight_formats import act_quant_e4m3, decode_fp8_block
    from b12x_toolchain.runtime.ops import triton_quant
    from b12x_toolchain.runtime.ops.opset import ops as R
    from benchmarks.kernel_cases import (
        FP8_LINEAR_CASES,
        FP8_LINEAR_FULL,
        accumulation_bound,
        fp8_linear_case,
        fp8_linear_work,
    )

    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    has_fp8 = capability is None or capability >= triton_quant.FP8_MMA_CAPABILITY  # the interpreter runs it
    for spec in specs or FP8_LINEAR_CASES + (FP8_LINEAR_FULL if device == "cuda" else []):
        rows, n_out, n_in, block, encoding = spec
        x, weight, scale = fp8_linear_case(*spec)
        want = R.fp8_block_linear(x, weight, scale, *block, "deepseek")
        bound = accumulation_bound(act_quant_e4m3(x), decode_fp8_block(weight, scale, block))
        args = [t.to(device, copy=True) for t in (x, weight, scale)]
        name = f"fp8 linear {rows}x{n_out}x{n_in} {block[0]}x{block[1]} {encoding}"
        # What a device without FP8 MMA takes (Ampere's 8.0; the float32 dot in the interpreter).
        without = triton_quant.fp8_linear_dot(capability and (8, 0), "deepseek", encoding == "ue8m0", x.dtype)
        got = {}
        for dot in (["fp8"] if has_fp8 else []) + [without]:
            def call(dot=dot):
                return triton_quant.fp8_block_linear_by(dot, *args, *block, "deepseek")

            got[dot] = call().cpu()
            error = (got[dot] - want).abs()
            share = (error / bound.clamp_min(torch.finfo(torch.float32).tiny)).max().item()
            record(f"{name} {dot} dot", bool((error <= bound).all()),
                   f"max error {error.max().item():.2e}; the worst element uses {share:.3f} of its bound")
            if device == "cuda" and spec in FP8_LINEAR_FULL:
                t = _graph_seconds(call)
                record(f"{name} {dot} dot time", None, f"{t * 1e6:,.1f} us per call in a CUDA graph",
                       roofline(t, fp8_linear_work(*spec, dot), card_peaks()))
        if not has_fp8:
            record(f"{name} fp8 dot", None, f"not run: compute capability {capability} has no FP8 MMA")
        if device == "cuda":
            chosen = triton_quant.fp8_linear_dot(capability, "deepseek", encoding == "ue8m0", x.dtype)
            dispatched = torch.ops.b12x_toolchain.fp8_block_linear(*args, *block, "deepseek").cpu()
            record(f"{name} dispatcher", torch.equal(dispatched, got[chosen]), f"the op is the {chosen} dot bit for bit")


# ---------------------------------------------------------------- sessions


def poison(session) -> None:
    session.poison()


def staging_of(session, pass_name: str, kind: str | None = None) -> list[str]:
    """The staging buffers a pass writes (of one kind), from the manifest's data, not names."""
    return [s.name for s in session.package.passes[pass_name].inputs
            if s.role == "staging" and (kind is None or s.info.kind == kind)]


def poisoned_step(session, slots, positions, draft_tokens, verify_tokens, accept):
    """Draft, verify and commit one step with reusable storage poisoned before each replay.

    Returns (draft logits, verify logits, staging after each pass): what a fused and an
    unfused session must agree on byte for byte.
    """
    poison(session)
    draft = session.replay("draft", token_ids=draft_tokens, slot_ids=slots, positions=positions)["logits"].clone()
    staging = {k: session.staging[k].clone() for k in staging_of(session, "draft")}
    poison(session)
    verify = session.replay("verify", token_ids=verify_tokens, slot_ids=slots, positions=positions)["logits"].clone()
    staging.update({k: session.staging[k].clone() for k in staging_of(session, "verify")})
    session.replay("commit", slot_ids=slots, positions=positions, accepted_tokens=accept)
    return draft, verify, staging


def open_session(pkg, device: str, seed: int = 7, engram_tables: str = "device"):
    import torch

    from b12x_toolchain.runtime.serving.speculative import Decoder

    session = pkg.session(device=device, slots=4, max_rows=4, engram_tables=engram_tables)
    gen = torch.Generator().manual_seed(seed)
    for slot, length in enumerate(PROMPT_LENGTHS):
        Decoder(session).prefill(slot, torch.randint(0, pkg.vocab_size, (length,), generator=gen).tolist())
    return session


def fused_vs_unfused(fused, unfused) -> None:
    import torch

    sessions = (fused, unfused)
    vocab = fused.package.vocab_size
    for rows in (1, 3):
        gen = torch.Generator().manual_seed(100 + rows)
        slots = [1] if rows == 1 else [3, 0, 2]
        problems = []
        for step_no in range(3):
            positions = [fused.seq_lens[s] for s in slots]
            draft_tokens = torch.randint(0, vocab, (rows, 7), generator=gen).tolist()
            verify_tokens = torch.randint(0, vocab, (rows, 8), generator=gen).tolist()
            accept = torch.randint(0, 9, (rows,), generator=gen).tolist()
            accept[0] = 8 if step_no == 0 else accept[0]
            seen = [poisoned_step(session, slots, positions, draft_tokens, verify_tokens, accept)
                    for session in sessions]
            (d0, v0, s0), (d1, v1, s1) = seen
            if not (torch.equal(d0, d1) and torch.equal(v0, v1)):
                problems.append(f"logits differ at step {step_no}")
            problems += [f"staging {k} step {step_no}" for k in s0 if not torch.equal(s0[k], s1[k])]
            problems += [f"persistent {k} step {step_no}" for k in fused.caches
                         if not torch.equal(fused.caches[k], unfused.caches[k])]
        record(f"fused = unfused, rows {rows}", not problems,
               "; ".join(problems[:3]) or "staging, persistent caches and logits identical, 3 poisoned steps")


def mirror_pages(source, target) -> None:
    """Give every slot of `target` the very pages the same slot holds in `source` (whose cache
    bytes `target` was given): a new session's page tables start empty, so it would hand these
    slots fresh pages, read other slots' entries there, and poison the pages it thinks free.

    Each page is taken once (a placement of our choosing), adopted by every slot that holds
    it (adopt shares held pages only), then let go once: each ends held by its slots alone."""
    taken = []
    for slot in range(source.slots):
        pages = {pool: tuple(source.pages.held[pool][slot]) for pool in source.pages.pools}
        for pool, ids in pages.items():
            for page in ids:
                if not target.pages.pools[pool].refs[page]:
                    taken.append((pool, target.pages.pools[pool].take(page=page)))
        if any(pages.values()):
            target.pages.adopt(slot, pages)
    for pool, page in taken:
        target.pages.pools[pool].release(page)


def cuda_vs_cpu(gpu_session, cpu_pkg) -> None:
    """Same cache bytes and page tables on both devices, one verify: the snapshot half of
    staging must agree (on the CPU dry run, the same device on both sides: everything)."""
    import torch

    from b12x_toolchain.runtime.formats.layout import token_view

    device = gpu_session.device.type
    cpu = cpu_pkg.session(device="cpu", slots=gpu_session.slots, max_rows=gpu_session.max_rows,
                          buffers={k: v.to("cpu", copy=True) for k, v in gpu_session.caches.items()})
    cpu.seq_lens = list(gpu_session.seq_lens)
    mirror_pages(gpu_session, cpu)
    slots = [3, 0, 2]
    positions = [gpu_session.seq_lens[s] for s in slots]
    tokens = torch.randint(0, cpu_pkg.vocab_size, (3, 8), generator=torch.Generator().manual_seed(5)).tolist()
    logits = []
    for session in (gpu_session, cpu):
        poison(session)
        out = session.replay("verify", token_ids=tokens, slot_ids=slots, positions=positions)
        logits.append(out["logits"].float().cpu())
    same_history, appended, differing = True, 0, 0
    for name in staging_of(cpu, "verify", "window_staging"):
        staging = cpu.staging[name]
        a, b = token_view(gpu_session.staging[name][:3]).cpu(), token_view(staging[:3])
        same_history &= torch.equal(a[:, :128], b[:, :128])
        appended += 3 * 8
        differing += (a[:, 128:136] != b[:, 128:136]).any(-1).sum().item()
    error = (logits[0] - logits[1]).abs().max().item()
    label = device.upper()
    record(f"{label} = CPU history snapshot", same_history, "verify staging rows 0..127 identical from identical caches")
    # Same device: one arithmetic, so the appended rows and logits must agree to the bit.
    why = "one device: must be 0" if device == "cpu" else "float math order differs across devices"
    record(f"{label} vs CPU appended rows", differing == 0 and error == 0 if device == "cpu" else None,
           f"{differing}/{appended} appended window rows differ, verify logits differ by up to {error:.2e} ({why})")


def host_tables(session, pkg) -> None:
    """Engram's tables in pinned host memory, read in place by the captured graphs: the same
    prefill and verify logits as with the tables on the device (on a CPU both are one place)."""
    import torch

    device = session.device.type
    host = open_session(pkg, device, engram_tables="host")
    tables = [t for name, t in host.weights.items() if name in pkg.manifest.weights.engram_tables]
    if device == "cuda":
        record("engram tables on the host are pinned", bool(tables) and all(t.is_pinned() for t in tables),
               f"{len(tables)} table tensors in page-locked host memory")
    slots = [0, 1]
    positions = [session.seq_lens[s] for s in slots]
    tokens = torch.randint(0, pkg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9)).tolist()
    logits = [s.replay("verify", token_ids=tokens, slot_ids=slots, positions=positions)["logits"].cpu()
              for s in (session, host)]
    record("engram host tables = device tables", torch.equal(*logits), "verify logits bit for bit after the same prefills")


def allocation(session) -> None:
    import torch

    slots, positions = [3, 0, 2], [session.seq_lens[s] for s in (3, 0, 2)]
    tokens = {name: torch.randint(0, session.package.vocab_size, (3, w), generator=torch.Generator().manual_seed(9)).tolist()
              for name, w in (("verify", 8), ("draft", 7))}
    for name in tokens:
        session.replay(name, token_ids=tokens[name], slot_ids=slots, positions=positions)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for i in range(REPLAYS):
        name = "verify" if i % 2 else "draft"
        session.replay(name, token_ids=tokens[name], slot_ids=slots, positions=positions)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    record(f"allocation over {REPLAYS} replays", after == before, f"memory_allocated {before} -> {after} bytes")


def _cudart():
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                return ctypes.CDLL(line.split()[-1])
    name = ctypes.util.find_library("cudart")
    return ctypes.CDLL(name) if name else None


def node_types(graph) -> Counter:
    """Node types of a captured graph (0 = kernel, 1 = memcpy, 2 = memset, ...) via cudaGraphGetNodes."""
    lib = _cudart()
    if lib is None:
        raise RuntimeError("libcudart is not loaded and cannot be found; cannot inspect graphs")
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    if lib.cudaGraphGetNodes(handle, None, ctypes.byref(count)) != 0:
        raise RuntimeError("cudaGraphGetNodes failed")
    nodes = (ctypes.c_void_p * count.value)()
    if lib.cudaGraphGetNodes(handle, nodes, ctypes.byref(count)) != 0:
        raise RuntimeError("cudaGraphGetNodes failed")
    types = Counter()
    for node in nodes[: count.value]:
        kind = ctypes.c_int(-1)
        if lib.cudaGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) != 0:
            raise RuntimeError("cudaGraphNodeGetType failed")
        types[kind.value] += 1
    return types


def graph_nodes(fused, unfused) -> None:
    results = fused.package.manifest.rewrites.results
    for pass_name in ("verify", "draft", "prefill", "commit"):
        fusion = results.get(pass_name, {}).get("fuse_window_snapshot")
        matches = fusion.matches if fusion is not None else 0
        for rows in sorted(fused.buckets[pass_name]):
            f = node_types(fused.graphs.graph(pass_name, rows))
            u = node_types(unfused.graphs.graph(pass_name, rows))
            ok = u[0] - f[0] == matches and sum(u.values()) - sum(f.values()) == matches
            record(f"kernel nodes {pass_name} rows {rows}", ok,
                   f"unfused {u[0]} kernels / {sum(u.values())} nodes, fused {f[0]} / {sum(f.values())}; "
                   f"expected {matches} fewer")


def _time_replays(session, pass_name: str, rows: int, count: int) -> float:
    import torch

    bucket = session.bucket_for(pass_name, rows)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        session.graphs.replay(pass_name, bucket)
    end.record()
    end.synchronize()
    return count / (start.elapsed_time(end) / 1000.0)


def replay_rate(fused, unfused) -> None:
    import torch

    for pass_name, width in (("verify", 8), ("draft", 7)):
        for rows in (1, 3):
            slots = [3, 0, 2][:rows]
            positions = [fused.seq_lens[s] for s in slots]
            tokens = torch.randint(0, fused.package.vocab_size, (rows, width), generator=torch.Generator().manual_seed(1)).tolist()
            for session in (fused, unfused):  # fills the bucket's static inputs
                session.replay(pass_name, token_ids=tokens, slot_ids=slots, positions=positions)
            rates = {"fused": [], "unfused": []}
            for round_no in range(10):  # alternating order: drift lands on both sides
                order = ("fused", "unfused") if round_no % 2 == 0 else ("unfused", "fused")
                for side in order:
                    rates[side].append(_time_replays(fused if side == "fused" else unfused, pass_name, rows, 200))
            f, u = statistics.median(rates["fused"]), statistics.median(rates["unfused"])
            record(f"replays/s {pass_name} rows {rows}", f >= u, f"fused {f:,.0f}/s, unfused {u:,.0f}/s ({f / u:.3f}x)")


def tiny_packages(folder: Path | None):
    """The tiny recipe's fused and unfused packages: loaded from `folder` (FOLDER/fused and
    FOLDER/unfused, as `b12x export --recipe dsv41-tiny [--no-fuse]` writes them), so a GPU
    machine can qualify packages exported elsewhere, as a CI export step would; or exported
    here. Loading them imports nothing of the exporter (a runtime alone must serve them)."""
    from b12x_toolchain.runtime import load

    if folder is None:
        return export_tiny()
    found = {kind: sorted((folder / kind).glob("*.b12x")) for kind in ("fused", "unfused")}
    for kind, paths in found.items():
        if len(paths) != 1:
            raise FileNotFoundError(f"{folder / kind}: expected one exported .b12x package, found {len(paths)}")
    return load(found["fused"][0]), load(found["unfused"][0])


def export_tiny():
    """Both packages exported into a temporary folder: the one place this script uses the exporter."""
    from b12x_toolchain.exporter.pipeline.export import export_package
    from b12x_toolchain.exporter.recipe.loader import load_recipe
    from b12x_toolchain.runtime import load

    with tempfile.TemporaryDirectory(prefix="b12x-gpu-check-") as tmp:
        recipe = load_recipe("dsv41-tiny")
        return (load(export_package(recipe, Path(tmp) / "fused").path),
                load(export_package(recipe, Path(tmp) / "unfused", fuse=False).path))


def exporter_modules() -> list[str]:
    return sorted(name for name in sys.modules if name.startswith("b12x_toolchain.exporter"))


def sessions(device: str, packages: Path | None = None) -> None:
    fused_pkg, unfused_pkg = tiny_packages(packages)
    if packages is not None:
        loaded = exporter_modules()
        record("packages loaded by the runtime alone", not loaded,
               f"exporter modules imported: {', '.join(loaded[:3])}" if loaded else "no exporter module imported")
    t = time.perf_counter()
    fused, unfused = open_session(fused_pkg, device), open_session(unfused_pkg, device)
    what = "every bucket of the 4 passes warmed up and captured" if device == "cuda" else "no capture on the CPU"
    record("sessions prepared", True, f"fused and unfused, prefilled: {what}, {time.perf_counter() - t:.1f}s")
    host_tables(fused, fused_pkg)  # first: the host session is prefilled as `fused` is now (verify commits nothing)
    fused_vs_unfused(fused, unfused)
    cuda_vs_cpu(fused, fused_pkg)  # on the CPU dry run: the same device on both sides, so equal to the bit
    if device == "cpu":
        return
    allocation(fused)
    graph_nodes(fused, unfused)
    replay_rate(fused, unfused)


# ---------------------------------------------------------------- bandwidth


def _graph_of(fn, count: int):
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(count):
            fn()
    return graph


def bandwidth() -> None:
    import torch

    from b12x_toolchain.runtime.formats.codecs import get_format
    from b12x_toolchain.runtime.formats.layout import staging_shape
    from benchmarks.kernel_cases import window_writer_work

    rows, width, dim, page = BANDWIDTH_ROWS, 8, 512, 64
    row_bytes = get_format("dsv41_mxfp8").row_bytes(dim)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ring = torch.randint(0, 256, (rows + 1, 128, row_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    staging = torch.empty(staging_shape(rows, 128 + width, row_bytes, "NHD", page), dtype=torch.uint8, device="cuda")
    kv = torch.randn(rows, width, dim, device="cuda", generator=gen)
    row_ids = torch.randperm(rows + 1, device="cuda", generator=gen)[:rows].to(torch.int32)
    positions = torch.randint(0, 4096, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    written = rows * (128 + width) * row_bytes
    src = torch.randint(0, 256, (written,), dtype=torch.uint8, device="cuda", generator=gen)
    dst = torch.empty_like(src)
    fused = lambda: torch.ops.b12x_toolchain.window_snapshot_append(ring, staging, kv, row_ids, positions, 128, "NHD", page, "dsv41_mxfp8")
    copy = lambda: dst.copy_(src)
    # Each side is captured as a graph of back-to-back launches, so the timing sees GPU
    # time only, not the host's dispatch between launches.
    graphs = {"fused": _graph_of(fused, LAUNCHES_PER_GRAPH), "copy": _graph_of(copy, LAUNCHES_PER_GRAPH)}
    times = {"fused": [], "copy": []}
    for round_no in range(20):
        for name in (("fused", "copy") if round_no % 2 == 0 else ("copy", "fused")):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 1000.0 / LAUNCHES_PER_GRAPH)
    t_fused, t_copy = statistics.median(times["fused"]), statistics.median(times["copy"])
    ratio = t_copy / t_fused
    record("fused writer bandwidth", ratio >= MIN_BANDWIDTH_RATIO,
           f"{written / t_fused / 1e9:,.0f} GB/s written vs copy {written / t_copy / 1e9:,.0f} GB/s "
           f"({ratio:.0%} of copy; needs {MIN_BANDWIDTH_RATIO:.0%}), {written / 1e6:.0f} MB",
           roofline(t_fused, window_writer_work(rows, width, dim), card_peaks()))


# ---------------------------------------------------------------- main


def table() -> str:
    width = max(len(c.name) for c in RESULTS)
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    for c in RESULTS:
        lines.append(f"{c.name:<{width}}  {({True: 'PASS', False: 'FAIL', None: 'info'})[c.ok]:<6}  {c.detail}")
    return "\n".join(lines)


def environment(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "device": device, "python": sys.version.split()[0]}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = "absent"
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        info["cuda"] = torch.version.cuda
    return info


def run_part(part, *args) -> None:
    """One group of checks; one that raises is a failed check named for it, and the rest still run."""
    try:
        part(*args)
    except Exception as error:  # a qualification reports every failure, not the first
        traceback.print_exc()
        first_line = str(error).splitlines()[0] if str(error) else ""
        record(f"{part.__name__} raised", False, f"{type(error).__name__}: {first_line}"[:300])


def write_json(path: Path | None, env: dict, started: float) -> None:
    """The checks so far: written after every part, so a run stopped by a timeout keeps them."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": env, "seconds": time.perf_counter() - started,
                                "checks": [asdict(c) for c in RESULTS]}, indent=2))


def plan(device: str, packages: Path | None, quick: bool) -> list:
    """(part, arguments) in the order they run; --quick: one case of each kernel group."""
    from benchmarks.kernel_cases import FP8_LINEAR_CASES, SPARSE_CASES

    parts = [(kernel_bytes, (device, quick)),
             (sparse_kernels, (device, SPARSE_CASES[1:2] if quick else None, not quick)),
             (mhc_kernel, (device, quick)), (engram_kernels, (device,)),
             (fp8_linears, (device, FP8_LINEAR_CASES[3:4] if quick else None)),
             (sessions, (device, packages))]
    if device == "cuda":
        parts += [(bandwidth, ()), (sparse_timing, ())]
    return parts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the checks as JSON here")
    parser.add_argument("--packages", type=Path,
                        help="the tiny recipe's packages exported elsewhere, in PATH/fused and PATH/unfused (default: export here)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: dry run of this script (Triton interpreter, no capture); proves nothing about a GPU")
    parser.add_argument("--quick", action="store_true", help="one case of each kernel group: a dry run of the script")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to qualify (use --device cpu for a dry run of the script)", file=sys.stderr)
        return 2
    from b12x_toolchain.runtime.ops import opset as ops

    if args.device == "cuda" and not ops.CUDA_KERNELS:
        print("CUDA is available but the Triton kernels are not registered: install the cuda extra", file=sys.stderr)
        return 2
    started = time.perf_counter()
    env = environment(args.device)
    print("environment:", json.dumps(env), flush=True)
    for part, part_args in plan(args.device, args.packages, args.quick):
        run_part(part, *part_args)
        write_json(args.json, env, started)
    elapsed = time.perf_counter() - started
    failed = [c.name for c in RESULTS if c.ok is False]
    print()
    print(table())
    if roofline_table():
        print("\n" + roofline_table())
    print(f"\n{sum(c.ok is True for c in RESULTS)} passed, {len(failed)} failed in {elapsed:.0f}s on {env.get('gpu', args.device)}")
    write_json(args.json, env, started)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
