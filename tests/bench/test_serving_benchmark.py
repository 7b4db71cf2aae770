"""The serving benchmark runs and reports every case, well formed; it never asserts a speed.

It runs in-process on the session's small package (the runner would export its own, which
takes longer than the benchmark itself at one round): every case drives the engine the same
way on any package, and two layers replay in about half the tiny recipe's time.
"""

from __future__ import annotations

import pytest

from b12x_toolchain.runtime import load  # noqa: E402
from benchmarks.registry import Settings  # noqa: E402
from benchmarks.run import discover, table  # noqa: E402
from benchmarks.serving import CONCURRENCY, measure  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow(minutes=0.3)]


def test_serving_benchmark_reports_speculation_and_concurrency(small_path):
    assert "serving" in discover()
    results = measure(load(small_path), Settings(repeat=1, warmup=0))
    cases = [(m.benchmark, m.case) for m in results]
    assert cases == [("serving.speculative_vs_plain", "1 request, drafts = greedy continuation")] + [
        ("serving.concurrency", f"{n} concurrent") for n in CONCURRENCY]
    for m in results:
        assert m.unit == "tokens/s" and m.baseline > 0 and m.candidate > 0
        assert m.ratio == pytest.approx(m.candidate / m.baseline, rel=1e-12)
        assert len(m.baseline_samples) == len(m.candidate_samples) == 1
    spec = results[0].params
    # Drafts are the target's own greedy continuation: all accepted, a full verify width per step.
    assert spec["speculative_acceptance_rate"] == 1.0 and spec["speculative_tokens_per_step"] == 8.0
    assert spec["plain_tokens_per_step"] == 1.0 and spec["plain_steps"] == 32
    assert [m.params["requests"] for m in results[1:]] == list(CONCURRENCY)
    assert table(results).row_count == len(results)
