"""The benchmark runner works: it runs, and its JSON has every expected case, well formed.

These tests never assert a speed — a benchmark's numbers depend on the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "benchmarks" / "run.py"

TIMED = {"replay.fused_vs_unfused", "replay.ours_vs_eager"}
TIMED_CASES = {"verify rows=1", "verify rows=3 (bucket 4)", "draft rows=1", "draft rows=3 (bucket 4)"}
NODE_CASES = {"prefill", "verify", "draft", "commit"}


def run_runner(*args: str) -> subprocess.CompletedProcess:
    # A separate process: exercises the command line exactly as documented, from the repository root.
    return subprocess.run([sys.executable, str(RUNNER), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_runner_writes_every_replay_case(tmp_path):
    out = tmp_path / "bench.json"
    # One thread: the quickest and least contention-prone way through on a small machine.
    proc = run_runner("--only", "replay", "--repeat", "1", "--warmup", "0", "--threads", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for column in ("benchmark", "case", "baseline", "candidate", "ratio"):
        assert column in proc.stdout

    report = json.loads(out.read_text())
    assert report["torch"] and report["cpu_count"] >= 1
    assert report["settings"] == {"repeat": 1, "warmup": 0}
    assert report["environment"]["torch_threads"] == 1
    assert report["benchmarks"] == ["replay"]

    cases = {}
    for m in report["measurements"]:
        assert (m["benchmark"], m["case"]) not in cases, f"duplicate {m['benchmark']} {m['case']}"
        cases[(m["benchmark"], m["case"])] = m
    expected = {(b, c) for b in TIMED for c in TIMED_CASES} | {("replay.graph_nodes", c) for c in NODE_CASES}
    assert set(cases) == expected

    for (bench, case), m in cases.items():
        assert m["baseline"] > 0 and m["candidate"] > 0, (bench, case)
        assert m["ratio"] == pytest.approx(m["candidate"] / m["baseline"], rel=1e-12), (bench, case)
        if bench in TIMED:
            assert m["unit"] == "ms"
            assert len(m["baseline_samples"]) == len(m["candidate_samples"]) == 1
            assert m["params"]["bucket"] == (1 if m["params"]["rows"] == 1 else 4)
        else:
            assert m["unit"] == "nodes"
            assert m["baseline"] == int(m["baseline"]) and m["candidate"] == int(m["candidate"])


def test_unknown_benchmark_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_runner("--only", "no-such-benchmark", "--json", str(out))
    assert proc.returncode == 2
    assert "unknown benchmark 'no-such-benchmark'" in proc.stderr and "replay" in proc.stderr
    assert not out.exists()


def test_prefix_cache_benchmark_parts_work(tmp_path):
    """The full prefix_cache benchmark exports a 4k recipe and prefills cold for seconds, so only
    its parts are run here: the recipe variant is valid and the L2 read cases measure."""
    from b12x.runtime.prefix_keys import Identity, token_bytes, token_hash
    from b12x.runtime.snapshot import Snapshot
    from benchmarks import prefix_cache
    from benchmarks.registry import REGISTRY, Settings

    assert REGISTRY["prefix_cache"] is prefix_cache.prefix_cache_benchmark
    recipe = prefix_cache.long_recipe()
    assert recipe.model.max_seq_len == 4096 >= prefix_cache.PROMPT_TOKENS
    assert prefix_cache.PREFIX_TOKENS % recipe.passes.prefill.chunk == 0
    ident = Identity.of({"test": "bench"})
    tokens = token_bytes(range(10))
    rows = torch.zeros(4, 36, dtype=torch.uint8)
    snap = Snapshot(ident, 10, tokens, token_hash(ident.key, tokens), {"cache.x": rows}, {"cache.x": {"rows": 4}})
    [m] = prefix_cache.read_cases(tmp_path, {"tiny": snap}, Settings(repeat=1, warmup=0))
    assert m.benchmark == "prefix_cache.l2_read" and m.params["bytes"] > rows.nbytes and m.params["l2_MBps"] > 0


def test_reexport_benchmarks_are_registered(tmp_path):
    proc = run_runner("--only", "no-such-benchmark", "--json", str(tmp_path / "bench.json"))
    assert proc.returncode == 2
    assert "export.structural" in proc.stderr and "rewrite.scaling" in proc.stderr
