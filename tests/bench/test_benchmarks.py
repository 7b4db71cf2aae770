"""The benchmark runner works: it runs, and its JSON has every expected case, well formed.

These tests never assert a speed — a benchmark's numbers depend on the machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from paths import ROOT  # noqa: E402

pytestmark = pytest.mark.slow(minutes=0.6)  # the module's time on two busy cores: longest runs first

RUNNER = ROOT / "benchmarks" / "run.py"


TIMED = {"replay.fused_vs_unfused", "replay.ours_vs_eager", "replay.overhead"}
TIMED_CASES = {"verify rows=1", "verify rows=3 (bucket 4)", "draft rows=1", "draft rows=3 (bucket 4)"}
NODE_CASES = {"prefill", "verify", "draft", "commit", "decode"}


def run_runner(*args: str) -> subprocess.CompletedProcess:
    # A separate process: exercises the command line exactly as documented, from the repository root.
    return subprocess.run([sys.executable, str(RUNNER), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
def test_runner_writes_every_replay_case(fused_path, unfused_path, tmp_path):
    out = tmp_path / "bench.json"
    # One thread: the quickest and least contention-prone way through on a small machine.
    # The session's packages of the replay recipe stand in for the runner's own exports.
    proc = run_runner("--only", "replay", "--repeat", "1", "--warmup", "0", "--threads", "1", "--json", str(out),
                      "--packages", str(fused_path), str(unfused_path))
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


def refused(tmp_path, capsys) -> str:
    """The runner's main, in this process, given an unknown benchmark: its error output.
    (The runner test above runs the command line itself; a refusal needs no process of its own.)"""
    from benchmarks.run import main

    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as exited:
        main(["--only", "no-such-benchmark", "--json", str(out)])
    assert exited.value.code == 2
    assert not out.exists()
    return capsys.readouterr().err


def test_unknown_benchmark_is_refused_before_anything_runs(tmp_path, capsys):
    err = refused(tmp_path, capsys)
    assert "unknown benchmark 'no-such-benchmark'" in err and "replay" in err


def test_prefix_cache_benchmark_parts_work(tmp_path):
    """The full prefix_cache benchmark exports a 4k recipe and prefills cold for seconds, so only
    its parts are run here: the recipe variant is valid and the L2 read cases measure."""
    from b12x_toolchain.runtime.prefix.keys import Identity, token_bytes, token_hash
    from b12x_toolchain.runtime.prefix.snapshot import Snapshot
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


def test_reexport_benchmarks_are_registered(tmp_path, capsys):
    err = refused(tmp_path, capsys)  # the refusal lists every benchmark the runner knows
    assert "export.structural" in err and "rewrite.scaling" in err


@pytest.mark.slow
def test_v4_reference_benchmark_measures_and_agrees(dsv4_small_path, one_torch_thread):
    """The V4 benchmark in-process on a small fp32 variant (the runner would export dsv4-tiny
    twice; conftest's dsv4_small_path, as the benchmark exports it): every case is a
    well-formed tokens/s pair, and the greedy streams agree."""
    pytest.importorskip("transformers")
    from b12x_toolchain.runtime import load
    from benchmarks import v4_reference
    from benchmarks.registry import REGISTRY, Settings
    from benchmarks.run import table

    assert REGISTRY["v4_reference"] is v4_reference.v4_reference_benchmark
    package = load(dsv4_small_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a stream mismatch is warned about: here, fail
        results = v4_reference.measure(package, Settings(repeat=1, warmup=0), prompt_tokens=80, new_tokens=17,
                                       label="small")

    assert [(m.benchmark, m.case) for m in results] == [
        ("v4_reference.decode", "greedy, 1 token/step (small)"),
        ("v4_reference.decode", "speculative, oracle drafts (small)"),
        ("v4_reference.prefill", "80 tokens (small)"),
    ]
    for m in results:
        assert m.unit == "tokens/s" and (m.baseline_label, m.candidate_label) == ("transformers", "b12x")
        assert m.baseline > 0 and m.candidate > 0
        assert m.ratio == pytest.approx(m.candidate / m.baseline, rel=1e-12)
        assert len(m.baseline_samples) == len(m.candidate_samples) == 1
        assert m.params["cache_formats"] == v4_reference.FP32_CACHES
    greedy, spec, prefill = (m.params for m in results)
    assert greedy["tokens_agree"] and greedy["first_difference"] is None and greedy["b12x_steps"] == 16
    assert spec["reference"]["tokens_agree"] and spec["vs_plain_tokens_agree"]
    # Drafts are the greedy continuation: all accepted, a full verify width per step.
    assert spec["b12x_acceptance_rate"] == 1.0 and spec["b12x_tokens_per_step"] == 8.0 and spec["b12x_steps"] == 2
    assert prefill["first_token_agrees"] and prefill["b12x_replays"] == 2
    assert table(results).row_count == len(results)


def test_replay_refuses_packages_that_are_not_its_fused_and_unfused_exports(fused_path, unfused_path):
    from b12x_toolchain.exporter.recipe.loader import load_recipe
    from benchmarks.registry import Settings
    from benchmarks.replay import RECIPE, packages

    # The runner test above replays the right pair; swapped, they are refused before loading.
    recipe = load_recipe(RECIPE)
    with pytest.raises(SystemExit, match="is not the fused export of the dsv41-tiny recipe"):
        packages(recipe, Settings(packages=(unfused_path, fused_path)))
