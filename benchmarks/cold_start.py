"""Cold start: how long a fresh process takes from nothing to its first token, by phase.

Each sample is a new Python process (`python -m benchmarks.cold_start MODE PACKAGE PATH`),
so imports and first-call costs count as they do for a user; the old path and the new
path run in alternating rounds, in the same benchmark run, on the same package:

* old: torch.export.load of every pass at load (what `load` did before pass_graph.py),
  and a session of every pass;
* new: graphs built straight from the checked JSON (graph_loader.py), each pass when first
  used, and a session of only the passes the engine replays (serving.engine.passes_used),
  which builds their replay graphs (no described values: pass_graph.PassGraph.replay).

Modes and the phases they report (ms):

* `session` (dsv41-tiny): import (torch, then the runtime), load, session, first token
  (one 8-token prompt, speculative decoding), and `after_torch` = everything after torch's
  import up to the first token;
* `run` (dsv41-tiny): `b12x run PKG --prompt-ids 1,...,8 --max-new-tokens 1` in the child,
  import of the CLI and the command (to its first and only token, and its report);
* both also report `after_torch_cpu`: the child's CPU time (user and system) over the same
  span as `after_torch`. On a shared machine wall time includes waiting for a core; CPU
  time is what the work costs;
* `graphs` (full-size dsv41, structural): load (every check, no weights bound) and the
  deserialisation of every pass graph; `peak_rss` is the child's peak resident memory (MiB).

Full-size rounds are capped at FULL_ROUNDS, the tiny ones at TINY_ROUNDS (whatever
--repeat says): one old-path process takes a minute there.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.registry import Measurement, Settings, benchmark

ROOT = Path(__file__).resolve().parent.parent
PROMPT = list(range(1, 9))
MARK = "cold_start phases: "
OLD, NEW = "torch.export.load, every pass", "memoised, passes used"
TINY_ROUNDS, FULL_ROUNDS = 3, 2
FULL_RECIPE = "dsv41"


def _phases(mode: str, package: str, path: str) -> dict[str, float]:
    """What one child process measures; `path` is "old" or "new"."""
    start = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    after_torch, cpu_after_torch = time.perf_counter(), time.process_time()
    old = path == "old"
    from b12x_toolchain.runtime import load as runtime_load
    from b12x_toolchain.runtime.package.pass_graph import DIRECT, TORCH

    def load(*args, **kwargs):
        package = runtime_load(*args, graph_loader=TORCH if old else DIRECT, **kwargs)
        if old:  # as before: every pass deserialised at load
            for info in package.passes.values():
                info.program  # noqa: B018  (reading it deserialises it)
        return package

    if mode == "run":
        import b12x_toolchain.runtime as runtime
        from b12x_toolchain.exporter.cli.main import main

        runtime.load = load  # cmd_run imports it from here when it runs
        imported = time.perf_counter()
        main(["run", package, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "1"],
             standalone_mode=False)
        done = time.perf_counter()
        return {"import": imported - start, "command": done - imported, "after_torch": done - after_torch,
                "after_torch_cpu": time.process_time() - cpu_after_torch}
    if mode == "graphs":
        import resource

        imported = time.perf_counter()
        loaded = runtime_load(package, graph_loader=TORCH if old else DIRECT)
        checked = time.perf_counter()
        for info in loaded.passes.values():
            info.program  # noqa: B018
        done = time.perf_counter()
        return {"load": checked - imported, "graphs": done - checked, "load_and_graphs": done - imported,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # KiB on Linux
    from b12x_toolchain.runtime.serving.engine import Engine, passes_used
    from b12x_toolchain.runtime.serving.requests import Request

    imported = time.perf_counter()
    loaded = load(package)
    checked = time.perf_counter()
    session = loaded.session(slots=1, passes=None if old else passes_used(loaded.passes))
    ready = time.perf_counter()
    engine = Engine(session)
    [state] = engine.submit([Request(prompt=PROMPT, max_new_tokens=1)])
    engine.step()
    first, cpu = state.first_token_at, time.process_time()
    return {"import": imported - start, "load": checked - imported, "session": ready - checked,
            "first_token": first - ready, "after_torch": first - after_torch,
            "after_torch_cpu": cpu - cpu_after_torch}


def _child(mode: str, package: Path, path: str) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.cold_start", mode, str(package), path], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"cold_start {mode} {path}: child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK):])


def _compare(mode: str, package: Path, rounds: int, params: dict) -> list[Measurement]:
    """Old and new child processes in alternating rounds; one row per phase, medians."""
    samples = {"old": [], "new": []}
    for i in range(rounds):
        for path in ("old", "new") if i % 2 == 0 else ("new", "old"):
            samples[path].append(_child(mode, package, path))
    rows = []
    for phase in samples["old"][0]:
        scale, unit = (1.0, "MiB") if phase == "peak_rss" else (1e3, "ms")
        a = [s[phase] * scale for s in samples["old"]]
        b = [s[phase] * scale for s in samples["new"]]
        base, cand = statistics.median(a), statistics.median(b)
        rows.append(Measurement("cold_start", f"{mode}.{phase}", unit, OLD, NEW, base, cand, cand / base,
                                params, a, b))
    return rows


def _package(folder: Path, recipe_name: str, structural: bool) -> Path:
    """The recipe's package in `folder`, exported there unless it already is."""
    from b12x_toolchain.exporter.pipeline.export import export_package
    from b12x_toolchain.exporter.recipe.loader import load_recipe

    path = folder / f"{recipe_name}.b12x"
    if not (path / "manifest.json").exists():
        export_package(load_recipe(recipe_name), folder, structural=structural)
    return path


@benchmark("cold_start")
def run(settings: Settings) -> list[Measurement]:
    with tempfile.TemporaryDirectory(prefix="b12x-cold-") as scratch:
        folder = Path(settings.exports or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        tiny = _package(folder, "dsv41-tiny", structural=False)
        rounds = min(settings.repeat, TINY_ROUNDS)
        rows = _compare("session", tiny, rounds, {"recipe": "dsv41-tiny", "rounds": rounds})
        rows += _compare("run", tiny, rounds, {"recipe": "dsv41-tiny", "rounds": rounds})
        full = _package(folder, FULL_RECIPE, structural=True)
        rounds = min(settings.repeat, FULL_ROUNDS)
        rows += _compare("graphs", full, rounds, {"recipe": FULL_RECIPE, "structural": True, "rounds": rounds})
    return rows


if __name__ == "__main__":  # one child process: python -m benchmarks.cold_start MODE PACKAGE old|new
    print(MARK + json.dumps(_phases(*sys.argv[1:4])), flush=True)
