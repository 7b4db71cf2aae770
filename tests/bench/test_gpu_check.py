"""The GPU qualification script on a machine without a GPU: it says so, and its kernel
checks run (in Triton's interpreter) and pass. Its GPU-only parts run only on a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from paths import ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_without_cuda_it_refuses_with_exit_2():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "no CUDA device: nothing to qualify" in proc.stderr


def test_kernel_checks_of_the_script_pass_here():
    pytest.importorskip("triton")
    from benchmarks import gpu_check

    gpu_check.RESULTS.clear()
    gpu_check.kernel_bytes("cuda" if torch.cuda.is_available() else "cpu")
    names = [c.name for c in gpu_check.RESULTS]
    assert len(names) == 17 and "kernel bytes w7 r3 d512" in names
    assert {f"row ops {fmt}" for fmt in ("dsv41_mxfp8 d512", "dsv41_nvfp4 d64", "dsv41_mxfp4 d128")} <= set(names)
    assert [c.name for c in gpu_check.RESULTS if not c.ok] == []


def test_mhc_check_of_the_script_passes_here():
    pytest.importorskip("triton")
    from benchmarks import gpu_check

    gpu_check.RESULTS.clear()
    gpu_check.mhc_kernel("cuda" if torch.cuda.is_available() else "cpu")
    assert [c.name for c in gpu_check.RESULTS] == [f"mhc hc_sinkhorn {s}" for s in ("1x1x4x4", "4x8x4x4", "8x64x4x4")]
    assert all(c.ok for c in gpu_check.RESULTS), [c.detail for c in gpu_check.RESULTS]


def test_engram_check_of_the_script_passes_here():
    pytest.importorskip("triton")
    from benchmarks import gpu_check

    gpu_check.RESULTS.clear()
    cuda = torch.cuda.is_available()
    gpu_check.engram_kernels("cuda" if cuda else "cpu")
    expected = ["engram hash 2x16, 3 orders x 2 heads", "engram lookup FP8 1x32 -> bf16"]
    assert [c.name for c in gpu_check.RESULTS] == expected + (["engram lookup, pinned host table in a CUDA graph"] if cuda else [])
    assert all(c.ok for c in gpu_check.RESULTS), [c.detail for c in gpu_check.RESULTS]


def test_a_part_that_raises_is_a_failed_check_and_the_next_part_still_runs():
    from benchmarks import gpu_check

    def export_step(device):
        raise RuntimeError(f"no kernel for {device}\nsecond line")

    def next_step(device):
        gpu_check.record("next", True, device)

    gpu_check.RESULTS.clear()
    gpu_check.run_part(export_step, "cuda")
    gpu_check.run_part(next_step, "cuda")
    assert [(c.name, c.ok, c.detail) for c in gpu_check.RESULTS] == [
        ("export_step raised", False, "RuntimeError: no kernel for cuda"), ("next", True, "cuda")]


def test_packages_exported_elsewhere_are_the_ones_qualified(small_path, small_unfused_path, tmp_path):
    import shutil

    from benchmarks import gpu_check

    # tiny_packages loads whichever pair the folder holds: the suite's small one stands in for the tiny recipe's.
    for kind, path in (("fused", small_path), ("unfused", small_unfused_path)):
        shutil.copytree(path, tmp_path / kind / path.name)
    fused, unfused = gpu_check.tiny_packages(tmp_path)
    assert (fused.path, unfused.path) == (tmp_path / "fused" / small_path.name,
                                          tmp_path / "unfused" / small_unfused_path.name)
    manifest = lambda path: (path / "manifest.json").read_bytes()
    assert manifest(fused.path) == manifest(small_path) != manifest(unfused.path) == manifest(small_unfused_path)
    shutil.rmtree(tmp_path / "unfused")
    with pytest.raises(FileNotFoundError, match="unfused: expected one exported .b12x package, found 0"):
        gpu_check.tiny_packages(tmp_path)


@pytest.mark.usefixtures("one_torch_thread")
def test_the_cpu_side_of_cuda_vs_cpu_reads_the_device_sessions_pages(small_pkg, monkeypatch):
    """Given the device session's cache bytes, the CPU session must also hold its page tables:
    with its own (empty) tables it hands the slots fresh pages and reads other slots' entries.
    On the CPU dry run both sides are one device, so everything must agree to the bit."""
    from benchmarks import gpu_check

    session = gpu_check.open_session(small_pkg, "cpu")
    gpu_check.RESULTS.clear()
    gpu_check.cuda_vs_cpu(session, small_pkg)
    assert [(c.name, c.ok) for c in gpu_check.RESULTS] == [("CPU = CPU history snapshot", True),
                                                           ("CPU vs CPU appended rows", True)]
    monkeypatch.setattr(gpu_check, "mirror_pages", lambda source, target: None)  # the bug this fixed
    gpu_check.RESULTS.clear()
    gpu_check.cuda_vs_cpu(session, small_pkg)
    assert gpu_check.RESULTS[1].ok is False, gpu_check.RESULTS[1].detail


def test_packages_given_are_loaded_without_importing_the_exporter(small_path, small_unfused_path, tmp_path):
    """A GPU machine's torch may be one that cannot export: --packages must need the runtime alone."""
    import shutil

    for kind, path in (("fused", small_path), ("unfused", small_unfused_path)):
        shutil.copytree(path, tmp_path / kind / path.name)
    code = ("import sys; from pathlib import Path; from benchmarks import gpu_check; "
            f"gpu_check.tiny_packages(Path({str(tmp_path)!r})); "
            "print(gpu_check.exporter_modules())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_roofline_floors_follow_the_cards_peaks():
    from benchmarks import gpu_check
    from benchmarks.kernel_cases import fp8_linear_work, sparse_work, window_writer_work

    assert gpu_check.peaks_for("NVIDIA H200")["bytes"] == 4.8e12
    assert gpu_check.peaks_for("NVIDIA H100 80GB HBM3")["bytes"] == 3.35e12  # the SXM card
    assert gpu_check.peaks_for("NVIDIA H100 PCIe")["card"] == "H100 PCIe"
    assert gpu_check.peaks_for("NVIDIA A100-SXM4-80GB") is None  # unknown: bandwidth measured on the card
    h200 = gpu_check.peaks_for("NVIDIA H200")
    # The full model's q_a projection at verify width 8: 7.9 MB of FP8 weights, memory-bound at ~1.7 us.
    q_a = fp8_linear_work(8, 1536, 5120, (32, 32), "ue8m0", "fp8")
    assert q_a == {"bytes": 1536 * 5120 + 48 * 160 + 8 * 5120 * 4 + 8 * 1536 * 4, "flops": 2 * 8 * 1536 * 5120,
                   "dot": "fp8"}
    line = gpu_check.roofline(37.1e-6, q_a, h200)
    assert line["bound"] == "memory" and line["floor_seconds"] == pytest.approx(1.684e-6, rel=1e-3)
    assert line["fraction"] == pytest.approx(0.0454, rel=1e-2)
    # Scoring 16k committed keys for 32 queries x 32 heads is compute-bound; attending the top-k is not the length's.
    shape = dict(gpu_check.SPARSE_FULL, topk=512, block_size=8, blocks=256)
    topk = sparse_work("topk", 16384, 4, 8, **shape)
    assert gpu_check.roofline(1e-3, topk, h200)["bound"] == "compute"
    assert sparse_work("attention top-k", 16384, 4, 8, **shape) == sparse_work("attention top-k", 4096, 4, 8, **shape)
    longer = sparse_work("attention all", 16384, 4, 8, **shape)["bytes"] - sparse_work("attention all", 4096, 4, 8, **shape)["bytes"]
    assert longer == 4 * (16384 - 4096) * 288  # every committed entry of each row: a 288-byte nvfp4 record
    assert window_writer_work(4096, 8, 512)["bytes"] == 4096 * (128 * 528 + 8 * 512 * 4 + 136 * 528)
    unknown = {"bytes": 2e12, "bf16": None, "fp8": None, "card": "measured"}
    assert gpu_check.roofline(1e-3, topk, unknown)["bound"] == "memory"  # no FLOP peak: bytes alone


def test_quick_plan_takes_one_case_of_each_kernel_group():
    from benchmarks import gpu_check

    parts = gpu_check.plan("cpu", None, quick=True)
    assert [part.__name__ for part, _ in parts] == ["kernel_bytes", "sparse_kernels", "mhc_kernel", "engram_kernels",
                                                    "fp8_linears", "sessions"]
    assert [len(args[1]) for part, args in parts if part.__name__ in ("sparse_kernels", "fp8_linears")] == [1, 1]
    assert [part.__name__ for part, _ in gpu_check.plan("cuda", None, quick=False)][-2:] == ["bandwidth", "sparse_timing"]
