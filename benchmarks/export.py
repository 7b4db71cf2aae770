"""What a CI re-export costs: the structural export of the full-size recipe, and how the
rewrite pipeline scales with graph size.

* export.structural — `dsv41` exported without weights, in a fresh process per run (so
  peak memory is the export's own), with one job and with two. Rows: total wall time
  and total CPU time (all processes) against the 60 s target, each pass's wall time
  against its CPU time, and peak resident memory (largest process) against the 4 GiB
  target. One run per job count: a run takes about a minute on an idle machine.
* rewrite.scaling — the verify graph of a 2-layer recipe and of the same recipe with
  4× and 16× the layers; the rewrite pipeline alone is timed on fresh copies of each
  graph. Rows: time at N× against 1×, and time per graph node at N× against 1× (a ratio
  at or below 1 means the pipeline scales no worse than linearly in the graph size).

Both report CPU time where wall time would mostly measure the neighbours: on a shared
two-core machine, other processes can stretch wall time several fold.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.registry import Measurement, Settings, benchmark

ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 60.0
TARGET_BYTES = 4 << 30
MIB = 1 << 20
JOB_COUNTS = (1, 2)
SCALES = (1, 4, 16)
BASE_LAYERS = 2

# Run in a child process: exports dsv41 structurally and prints what it measured as JSON.
EXPORT_SCRIPT = """
import json, resource, sys, tempfile, time
from pathlib import Path
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.loader import load_recipe
jobs = int(sys.argv[1])
started = time.perf_counter()
with tempfile.TemporaryDirectory() as tmp:
    result = export_package(load_recipe("dsv41"), Path(tmp), structural=True, jobs=jobs)
wall = time.perf_counter() - started
own, workers = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
cpu = sum(u.ru_utime + u.ru_stime for u in (own, workers))
print(json.dumps({"wall": wall, "cpu": cpu, "seconds": result.seconds, "cpu_seconds": result.cpu_seconds,
                  "peak": max([own.ru_maxrss * 1024, *result.peak_rss_bytes.values()])}))
"""


def _structural_export(jobs: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", EXPORT_SCRIPT, str(jobs)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"structural export with {jobs} job(s) failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _pair(bench, case, unit, base_label, cand_label, base, cand, params) -> Measurement:
    return Measurement(bench, case, unit, base_label, cand_label, base, cand, cand / base, params)


@benchmark("export.structural")
def structural_export(settings: Settings) -> list:
    out = []
    for jobs in JOB_COUNTS:
        run = _structural_export(jobs)
        wall_ms = run["wall"] * 1000
        params = {"recipe": "dsv41", "jobs": jobs}
        out.append(_pair("export.structural", f"wall time, jobs={jobs}", "ms", "target", "export",
                         TARGET_SECONDS * 1000, wall_ms, params))
        out.append(_pair("export.structural", f"cpu time, jobs={jobs}", "ms", "target", "all processes",
                         TARGET_SECONDS * 1000, run["cpu"] * 1000, params))
        for name, seconds in run["seconds"].items():
            # Ratio = the share of a core the pass got: about 1 on an idle machine.
            out.append(_pair("export.structural", f"{name}, jobs={jobs}", "ms", "wall", "cpu",
                             seconds * 1000, run["cpu_seconds"][name] * 1000, {**params, "pass": name}))
        out.append(_pair("export.structural", f"peak memory, jobs={jobs}", "MiB", "target", "largest process",
                         TARGET_BYTES / MIB, run["peak"] / MIB, params))
    return out


def _layers_variant(recipe, layers: int):
    """The recipe with `layers` target layers, alternating window-only and ratio-2."""
    from b12x_toolchain.exporter.recipe.variants import recipe_variant

    stages = recipe.model.draft.stages
    return recipe_variant(recipe, {
        "model.num_layers": layers,
        "model.compress_ratios": [0, 2] * (layers // 2) + [0] * stages,
        "model.draft.target_layer_ids": [layers - 1],
        "rewrites.0.expect_matches.verify": layers,
        "rewrites.0.expect_matches.draft": stages,
    }, name=f"scaling-{layers}")


def _pipeline_ms(recipe, repeat: int) -> tuple[float, int, int]:
    """Median pipeline CPU time on fresh copies of the captured verify graph, its node count, matches."""
    from b12x_toolchain.exporter.model.pass_modules import PASSES
    from b12x_toolchain.exporter.pipeline.capture import capture
    from b12x_toolchain.exporter.pipeline.structural import fake_weights
    from b12x_toolchain.exporter.recipe.dims import Dims
    from b12x_toolchain.passes.pipeline import rewrites_named
    from b12x_toolchain.runtime.rewrite import count_nodes, run_rewrites

    d = Dims.from_recipe(recipe)
    graph = capture(PASSES["verify"](d), fake_weights(d)).graph_module
    names = [r.name for r in recipe.rewrites]
    samples, matches = [], 0
    for _ in range(repeat):
        gm = copy.deepcopy(graph)
        started = time.process_time_ns()  # the pipeline is single-threaded Python: CPU time is its cost
        records = run_rewrites(gm, rewrites_named(names), "verify")
        samples.append((time.process_time_ns() - started) / 1e6)
        matches = records[0].matches
    return statistics.median(samples), count_nodes(graph), matches


@benchmark("rewrite.scaling")
def rewrite_scaling(settings: Settings) -> list:
    from b12x_toolchain.exporter.recipe.loader import load_recipe

    base = load_recipe("dsv41-tiny")
    runs = {scale: _pipeline_ms(_layers_variant(base, BASE_LAYERS * scale), max(settings.repeat, 1))
            for scale in SCALES}
    (t1, n1, _), out = runs[SCALES[0]], []
    for scale in SCALES[1:]:
        t, n, matches = runs[scale]
        params = {"layers": BASE_LAYERS * scale, "base_layers": BASE_LAYERS, "nodes": n, "base_nodes": n1,
                  "matches": matches, "exponent": round(math.log(t / t1) / math.log(n / n1), 3)}
        out.append(_pair("rewrite.scaling", f"verify pipeline, {scale}x layers", "ms", "1x", f"{scale}x",
                         t1, t, params))
        out.append(_pair("rewrite.scaling", f"verify pipeline per node, {scale}x layers", "us/node", "1x",
                         f"{scale}x", t1 * 1000 / n1, t * 1000 / n, params))
    return out
