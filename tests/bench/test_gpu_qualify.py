"""benchmarks/gpu_qualify.sh end to end on the CPU, so the one script a GPU machine runs
cannot rot: `prepare` (the suite's exported packages passed in, no wheels) and `run --device
cpu --quick`. Every row is in the combined table, the rows that mean something on a CPU pass,
the CUDA-only ones say "not run". The CUDA-only rows' own logic runs here too, on CPU
sessions, against the expectations the script prepared."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from paths import ROOT

pytestmark = pytest.mark.slow(minutes=0.7)  # the module's own time (40 s on two idle cores), shared exports aside
SCRIPT = ROOT / "benchmarks" / "gpu_qualify.sh"
CHECK_ROWS = {"kernel bytes w8 r3 d64", "row ops dsv41_mxfp8 d64", "mhc hc_sinkhorn 1x1x4x4", "engram lookup FP8 1x32 -> bf16",
              "packages loaded by the runtime alone", "sessions prepared", "engram host tables = device tables",
              "fused = unfused, rows 1", "fused = unfused, rows 3", "CPU = CPU history snapshot", "CPU vs CPU appended rows"}


@pytest.fixture(scope="module")
def qualified(shipped_path, small_path, small_unfused_path, tmp_path_factory):
    """OUT after prepare and run, and run's process. The suite's small pair goes in as the
    tiny packages: the script copies them into OUT/packages/tiny, and gpu_check.py --packages
    qualifies whichever fused and unfused pair it finds there."""
    out = tmp_path_factory.mktemp("qualify")
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    prepare = subprocess.run(["bash", str(SCRIPT), "prepare", str(out), "--no-wheels", "--quick", "--mini", str(shipped_path),
                              "--tiny-fused", str(small_path), "--tiny-unfused", str(small_unfused_path)],
                             env=env, capture_output=True, text=True, timeout=300)
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    run = subprocess.run(["bash", str(SCRIPT), "run", str(out), "--device", "cpu", "--quick"],
                         env=env, capture_output=True, text=True, timeout=600)
    return out, run


def table_rows(markdown: str) -> list[dict]:
    """The combined table's rows (part, check, result, figure, detail)."""
    rows = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 5 and cells[0] in ("decode", "check"):
            rows.append(dict(zip(("part", "check", "result", "figure", "detail"), cells)))
    return rows


def test_the_run_passes_and_writes_one_table_with_the_versions(qualified):
    out, run = qualified
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = (out / "qualify.md").read_text()
    assert report in run.stdout
    assert re.search(r"^- torch \S+, Triton \S+, Python \S+$", report, re.M)
    assert re.search(r"^- device: cpu .*driver: ", report, re.M)
    assert re.search(r"^- parts: decode \d+ s \(exit 0\), check \d+ s \(exit 0\)$", report, re.M)


def test_every_row_is_there_cpu_rows_pass_and_cuda_rows_are_not_run(qualified):
    from benchmarks.gpu_decode import CUDA_ONLY, ROWS

    rows = table_rows((qualified[0] / "qualify.md").read_text())
    decode = {r["check"]: r for r in rows if r["part"] == "decode"}
    assert list(decode) == list(ROWS)
    assert {name: r["result"] for name, r in decode.items() if name in CUDA_ONLY} == dict.fromkeys(CUDA_ONLY, "not run")
    assert {name: r["result"] for name, r in decode.items() if name not in CUDA_ONLY} == \
        {name: "pass" for name in ROWS if name not in CUDA_ONLY}
    check = {r["check"]: r["result"] for r in rows if r["part"] == "check"}
    assert CHECK_ROWS <= set(check)
    assert set(check.values()) == {"pass"}


def test_the_checkout_is_imported_through_the_mapped_import_root(qualified):
    """No install on the GPU machine: run maps the import root itself, and that is what ran."""
    out = qualified[0]
    environment = json.loads((out / "decode.json").read_text())["environment"]
    assert environment["import_root"] == str(out / "src" / "b12x_toolchain")
    assert (out / "src" / "b12x_toolchain" / "runtime").resolve() == ROOT / "runtime"


def test_the_tiny_packages_weights_travel_once(qualified, small_path):
    """The packages in OUT/packages/tiny (here the small pair) carry their shared weights once."""
    out = qualified[0]
    assert (out / "packages" / "tiny" / "unfused" / "WEIGHTS_ARE_FUSED").exists()
    restored = out / "packages" / "tiny" / "unfused" / small_path.name / "weights.safetensors"
    assert restored.read_bytes() == (small_path / "weights.safetensors").read_bytes()


@pytest.mark.usefixtures("one_torch_thread")
def test_the_cuda_rows_logic_holds_on_cpu_sessions(qualified, monkeypatch):
    """The rows a GPU alone answers, computed here between CPU sessions: the same device on both
    sides, so every comparison must come out equal (the rate ratio is only reported)."""
    from benchmarks import gpu_decode

    out = qualified[0]
    monkeypatch.setattr(gpu_decode.Run, "needs_cuda", lambda self: None)
    monkeypatch.setattr(gpu_decode, "TIMED_ROUNDS", 1)  # one round of each: the ratio is only reported
    run = gpu_decode.Run(next((out / "packages" / "mini").glob("*.b12x")), "cpu",
                         json.loads((out / "expect.json").read_text()), quick=False)
    assert gpu_decode.graph_vs_eager_tokens(run)[0]
    ok, figure, detail = gpu_decode.tokens_vs_cpu(run)
    assert ok and figure == "logit error 0.00e+00", detail
    assert gpu_decode.steps_vs_cpu(run)[:2] == (True, "1.000x")
    # The rows above keep their decodes; the rate row's timed rounds decode the workload anew,
    # and its ratio is only reported: one prompt's first tokens show the same logic.
    run.work = dict(run.work, prompts=run.work["prompts"][:1], new_tokens=4)
    assert re.fullmatch(r"[\d.]+x", gpu_decode.rates_graph_vs_eager(run)[1])


def test_near_ties_excuse_only_the_differences_after_them():
    from benchmarks.gpu_decode import first_difference, near_tie

    assert first_difference([1, 2, 3], [1, 2, 3]) is None and first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert near_tie([3.0, 0.5, 0.005], 1e-3) == 2 and near_tie([3.0, 0.5, 0.01], 1e-3) is None  # 8 x 1e-3
