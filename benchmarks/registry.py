"""The benchmark registry and the paired-measurement helpers every benchmark uses.

A benchmark is a function `fn(settings) -> list[Measurement]` registered under a name
with `@benchmark("name")`. Each Measurement pairs a baseline with a candidate and
reports ratio = candidate / baseline, so a ratio below 1 means the candidate is
smaller (faster, or fewer nodes) — or, for a rate such as tokens/s, slower.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REGISTRY: dict[str, Callable[["Settings"], list["Measurement"]]] = {}


def benchmark(name: str):
    """Register `fn` under `name`; the runner finds it by importing its module."""

    def register(fn):
        if name in REGISTRY:
            raise ValueError(f"benchmark {name!r} is registered twice")
        REGISTRY[name] = fn
        return fn

    return register


@dataclass(frozen=True)
class Settings:
    repeat: int = 20  # timed A/B rounds per case
    warmup: int = 2  # untimed rounds first: the first replays pay one-off allocation and dispatch costs
    packages: tuple | None = None  # (fused, unfused) package paths of the replay recipe, reused instead of exported
    exports: Path | None = None  # context_scaling, paged_memory, prefix_hit_ttft: export variants here, reused


@dataclass
class Measurement:
    benchmark: str
    case: str
    unit: str
    baseline_label: str
    candidate_label: str
    baseline: float
    candidate: float
    ratio: float
    params: dict = field(default_factory=dict)
    baseline_samples: list[float] = field(default_factory=list)
    candidate_samples: list[float] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _time_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e6


def _alternate(settings: Settings, baseline: Callable[[], float], candidate: Callable[[], float]):
    """Samples of two measuring callables, taken in alternating rounds (see compare_timed)."""
    if settings.repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {settings.repeat}")
    for _ in range(settings.warmup):
        baseline()
        candidate()
    a, b = [], []
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection mid-call would be charged to whichever side triggered it
    try:
        for i in range(settings.repeat):
            if i % 2 == 0:
                a.append(baseline())
                b.append(candidate())
            else:
                b.append(candidate())
                a.append(baseline())
    finally:
        if gc_was_enabled:
            gc.enable()
    return a, b


def compare_timed(benchmark: str, case: str, baseline: Callable[[], object], candidate: Callable[[], object],
                  settings: Settings, baseline_label: str, candidate_label: str,
                  params: dict | None = None) -> Measurement:
    """Time two callables in alternating rounds and compare their medians.

    Both sides run inside every round, so a slow stretch of the machine (another process,
    frequency scaling) lands on both rather than on whichever side happened to run then.
    The order flips every round so neither side always runs on a cache warmed by the other.
    Medians, not means, so a single preempted call does not move the result.
    """
    a, b = _alternate(settings, lambda: _time_ms(baseline), lambda: _time_ms(candidate))
    base, cand = statistics.median(a), statistics.median(b)
    return Measurement(benchmark, case, "ms", baseline_label, candidate_label, base, cand, cand / base,
                       params or {}, a, b)


def compare_rates(benchmark: str, case: str, baseline: Callable[[], float], candidate: Callable[[], float],
                  settings: Settings, baseline_label: str, candidate_label: str, unit: str,
                  params: dict | None = None) -> Measurement:
    """Like compare_timed, for callables that measure themselves and return a rate (tokens/s).

    Used where only part of a call is the thing measured (decoding, not the prefill before
    it). Same alternating rounds and medians; ratio = candidate / baseline, which for a
    rate means above 1 the candidate is faster.
    """
    a, b = _alternate(settings, baseline, candidate)
    base, cand = statistics.median(a), statistics.median(b)
    return Measurement(benchmark, case, unit, baseline_label, candidate_label, base, cand, cand / base,
                       params or {}, a, b)


def compare_counts(benchmark: str, case: str, baseline: int, candidate: int, unit: str,
                   baseline_label: str, candidate_label: str, params: dict | None = None) -> Measurement:
    """A deterministic pair (e.g. graph sizes): one value each, no repetition needed."""
    if baseline <= 0:
        raise ValueError(f"{benchmark} {case}: baseline {baseline} must be positive to form a ratio")
    return Measurement(benchmark, case, unit, baseline_label, candidate_label, float(baseline), float(candidate),
                       candidate / baseline, params or {})
