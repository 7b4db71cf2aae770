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


def test_packages_exported_elsewhere_are_the_ones_qualified(fused_path, unfused_path, tmp_path):
    import shutil

    from benchmarks import gpu_check

    for kind, path in (("fused", fused_path), ("unfused", unfused_path)):
        shutil.copytree(path, tmp_path / kind / path.name)
    fused, unfused = gpu_check.tiny_packages(tmp_path)
    assert (fused.path, unfused.path) == (tmp_path / "fused" / fused_path.name, tmp_path / "unfused" / unfused_path.name)
    manifest = lambda path: (path / "manifest.json").read_bytes()
    assert manifest(fused.path) == manifest(fused_path) != manifest(unfused.path) == manifest(unfused_path)
    shutil.rmtree(tmp_path / "unfused")
    with pytest.raises(FileNotFoundError, match="unfused: expected one exported .b12x package, found 0"):
        gpu_check.tiny_packages(tmp_path)
