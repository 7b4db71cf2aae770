"""What a parallel package of the full-size recipe holds per rank, and what exporting it costs.

* export.parallel — `dsv41` with `parallel: {tensor: 8, expert: 8}`, exported structurally
  (fake weights, every rank on torch's fake process group) in a fresh process with two
  jobs. Rows:
  - per-rank weight bytes against the whole model's (the ideal split's share is in params,
    with the replicated bytes and the replicated tensors' names), with the Engram tables on
    the device; with them in pinned host memory (`engram_tables="host"`), a rank's device
    bytes against the whole model's and its host bytes against all of its weights;
  - the split tensors' bytes on one rank against the ideal 1/8 of theirs (1.0 = exact);
  - per pass: collectives in rank 0's graph (all-reduce, all-gather), as a count against
    the number of target layers;
  - CPU and wall time of the whole export against eight one-device exports' 60 s target.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.registry import Measurement, Settings, benchmark

ROOT = Path(__file__).resolve().parents[1]
MAPPING = {"tensor": 8, "expert": 8}
JOBS = 2
TARGET_SECONDS = 60.0  # per rank: the one-device target, times the ranks

# Run in a child process: exports dsv41 at MAPPING structurally and prints what it measured as JSON.
EXPORT_SCRIPT = """
import json, resource, sys, tempfile, time
from pathlib import Path
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.runtime.package.reader import read_manifest
if __name__ == "__main__":
    mapping, jobs = json.loads(sys.argv[1]), int(sys.argv[2])
    recipe = recipe_variant(load_recipe("dsv41"), {"parallel": mapping}, name="dsv41-parallel")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = export_package(recipe, Path(tmp), structural=True, jobs=jobs)
        exported = read_manifest(result.path).parallel
    wall = time.perf_counter() - started
    own, workers = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    cpu = sum(u.ru_utime + u.ru_stime for u in (own, workers))
    print(json.dumps({"wall": wall, "cpu": cpu, "collectives": exported.collectives,
                      "peak": max([own.ru_maxrss * 1024, *result.peak_rss_bytes.values()])}))
"""


def _export(mapping: dict, jobs: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", EXPORT_SCRIPT, json.dumps(mapping), str(jobs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"parallel structural export failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _recipe(mapping: dict):
    from b12x_toolchain.exporter.recipe.loader import load_recipe
    from b12x_toolchain.exporter.recipe.variants import recipe_variant

    return recipe_variant(load_recipe("dsv41"), {"parallel": mapping})


@benchmark("export.parallel")
def parallel_export(settings: Settings) -> list:
    from b12x_toolchain.exporter.model.parallel import weight_bytes
    from b12x_toolchain.exporter.recipe.dims import Dims

    recipe = _recipe(MAPPING)
    d = Dims.from_recipe(recipe)
    sizes = weight_bytes(d)
    whole = sizes["sharded_ideal"] * d.world_size + sizes["replicated"]
    params = {"recipe": "dsv41", **MAPPING, "jobs": JOBS, "replicated_bytes": sizes["replicated"],
              "ideal_per_rank": whole / d.world_size, "replicated_tensors": len(sizes["replicated_names"]),
              "replicated_names": sizes["replicated_names"]}
    out = [Measurement("export.parallel", "weight bytes per rank", "GiB", "whole model", "rank",
                       whole / (1 << 30), sizes["per_rank"] / (1 << 30), sizes["per_rank"] / whole, params),
           Measurement("export.parallel", "device bytes per rank, tables on host", "GiB", "whole model", "rank",
                       whole / (1 << 30), sizes["per_rank_device"] / (1 << 30), sizes["per_rank_device"] / whole,
                       params),
           Measurement("export.parallel", "host bytes per rank, tables on host", "GiB", "rank's weights",
                       "Engram tables", sizes["per_rank"] / (1 << 30), sizes["per_rank_host"] / (1 << 30),
                       sizes["per_rank_host"] / sizes["per_rank"], params),
           Measurement("export.parallel", "split tensors per rank", "GiB", "ideal 1/8", "rank",
                       sizes["sharded_ideal"] / (1 << 30), sizes["sharded_per_rank"] / (1 << 30),
                       sizes["sharded_per_rank"] / sizes["sharded_ideal"], params)]
    run = _export(MAPPING, JOBS)
    for name, counts in run["collectives"].items():
        total = sum(counts.values())
        out.append(Measurement("export.parallel", f"collectives in {name}", "ops", "target layers", "collectives",
                               d.layers, total, total / d.layers, {**params, "pass": name, **counts}))
    target = TARGET_SECONDS * d.world_size * 1000
    out.append(Measurement("export.parallel", f"cpu time, {d.world_size} ranks", "ms", "8 x 60 s", "all processes",
                           target, run["cpu"] * 1000, run["cpu"] * 1000 / target, params))
    out.append(Measurement("export.parallel", f"wall time, {d.world_size} ranks", "ms", "8 x 60 s", "export",
                           target, run["wall"] * 1000, run["wall"] * 1000 / target, {**params, "peak": run["peak"]}))
    return out
