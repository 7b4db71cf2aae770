"""Which implementation serves each op, and that the CPU path never leaves the reference.

The CUDA kernels are registered for the CUDA dispatch key only. These tests register them
in a CPU-only process and check that CPU tensors still reach the torch references, that
no kernel launcher is entered, and that nothing imports FlashInfer.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paths import ROOT

OPS = ("window_snapshot", "cache_append", "window_snapshot_append", "window_read", "window_commit",
       "write_rows", "write_slots", "gather_rows", "stage_rows", "read_rows", "round_trip", "set_seq_len",
       "indexer_topk", "candidate_blocks", "sparse_attention", "hc_sinkhorn", "dense_linear", "fp8_block_linear",
       "fp4_expert_linear",
       "engram_hash", "engram_lookup")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_every_op_of_the_set_has_a_backend():
    pytest.importorskip("triton")
    from b12x_toolchain.runtime.ops.cuda_kernels import backend_for
    from b12x_toolchain.runtime.ops.opset import OPS as OPSET

    assert set(OPSET) == set(OPS)
    assert {name: backend_for(name, "cpu") for name in OPS} == dict.fromkeys(OPS, "reference")
    cuda = {name: backend_for(name, "cuda") for name in OPS}
    assert cuda == {**dict.fromkeys(OPS, "triton"), "set_seq_len": "reference"}
    with pytest.raises(ValueError, match="not an op of op set v7"):
        backend_for("window_magic", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only import path")
def test_cpu_import_registers_nothing_and_imports_no_triton():
    proc = _run("import sys; from b12x_toolchain.runtime.ops import opset as ops; import b12x_toolchain.runtime.session.session;"
                "print(ops.CUDA_KERNELS, 'triton' in sys.modules, 'flashinfer' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "False"]


def test_registered_cuda_kernels_leave_cpu_tensors_on_the_reference():
    pytest.importorskip("triton")
    code = r'''
import sys, torch
from b12x_toolchain.runtime.ops import opset as ops
from b12x_toolchain.runtime.ops import triton_rows
from b12x_toolchain.runtime.ops import triton_window
from b12x_toolchain.runtime.ops import cuda_kernels
from benchmarks.kernel_cases import window_case
R = torch.ops.b12x_toolchain

def results():
    case = window_case(torch.Generator().manual_seed(0), 3, 8, 64, 16)
    out = {}
    s = case["staging"].clone()
    R.window_snapshot_append(case["ring"], s, case["kv"], case["row_ids"], case["positions"], 128, "NHD", 16, "dsv41_mxfp8")
    out["fused"] = s
    ring = case["ring"].clone()
    R.window_commit(ring, s, case["row_ids"], case["positions"], case["accept_len"], 128, 8)
    out["commit"] = ring
    out["read"] = R.window_read(s, 136, 64, "dsv41_mxfp8")
    out["round_trip"] = R.round_trip(case["kv"], "dsv41_nvfp4")
    pages = torch.full((7, 4 * 66), 0xFF, dtype=torch.uint8)  # 4 window records of 64 values a page
    R.write_slots(pages, case["kv"], torch.arange(24).view(3, 8).flip(0) - 1, "dsv41_mxfp8")  # one -1
    out["write_slots"] = pages
    return out

before = results()
cuda_kernels.register()
cuda_kernels.register()  # idempotent

def refuse(*args, **kwargs):
    raise AssertionError("a CPU tensor reached a Triton launcher")

triton_window._launch = triton_window._commit = triton_rows._put = triton_rows._get = refuse
triton_rows._round_trip = triton_rows._source = refuse
after = results()
assert before.keys() == after.keys()
for k in before:
    assert torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)), k
assert "flashinfer" not in sys.modules
print("ok")
'''
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


def test_no_runtime_module_calls_flashinfer():
    # FlashInfer 0.7.4 has no writer for these byte formats (cuda_kernels' docstring), and
    # its wheel installs a top-level `b12x` package of its own (see the next test).
    offenders = []
    for path in sorted((ROOT / "runtime").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "flashinfer"]
    assert offenders == []


def test_import_root_is_this_project():
    # flashinfer-python ships a top-level `b12x` package of its own; this project's import
    # root is `b12x_toolchain`, so the two can share an environment.
    import b12x_toolchain

    assert Path(b12x_toolchain.__file__).resolve() == ROOT / "b12x-toolchain" / "__init__.py"
    assert b12x_toolchain.__version__
