"""Killed exports leave no partial package; sessions and loads work concurrently."""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import yaml

from b12x_toolchain.exporter.pipeline import export as export_module
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.pipeline.pass_export import run_jobs
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.speculative import Decoder

pytestmark = pytest.mark.slow(minutes=0.4)  # the module's time on two busy cores: longest runs first

# The child exports the small recipe; fsync is slowed so the kill can land mid-write,
# and it announces each phase on stdout so the parent knows what it interrupted. What is
# killed is the package's writing, so the child takes its captured passes from the parent
# (pickled pass outputs, `recorded_passes`) instead of tracing them again for a minute.
CHILD = textwrap.dedent("""
    import os, pickle, sys, time
    from b12x_toolchain.exporter.pipeline import export as export_module, package_writer
    from b12x_toolchain.exporter.pipeline.export import export_package
    from b12x_toolchain.exporter.recipe.loader import load_recipe

    with open(sys.argv[3], "rb") as f:
        recorded = pickle.load(f)
    def replay_jobs(jobs, workers, on_start=None, on_done=None):
        for job in jobs:
            if on_start is not None:
                on_start(job.label)
            on_done(recorded[job.label])
        return {job.label: recorded[job.label] for job in jobs}
    export_module.run_jobs = replay_jobs

    real_fsync = os.fsync
    def slow_fsync(fd):
        print("writing", flush=True)
        time.sleep(0.3)
        real_fsync(fd)
    package_writer.os.fsync = slow_fsync
    print("capturing", flush=True)
    export_package(load_recipe(sys.argv[1]), sys.argv[2])
    print("done", flush=True)
""")


@pytest.fixture(scope="module")
def recorded_passes(small_recipe, tmp_path_factory):
    """The small recipe's pass outputs, exported here and pickled for the child."""
    recorded = {}

    def recording(jobs, workers, on_start=None, on_done=None):
        outputs = run_jobs(jobs, workers, on_start, on_done)
        recorded.update(outputs)
        return outputs

    folder = tmp_path_factory.mktemp("recorded")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(export_module, "run_jobs", recording)
        export_package(small_recipe, folder / "out")
    path = folder / "passes.pickle"
    path.write_bytes(pickle.dumps(recorded))
    return path


def _child(recipe, out, recorded_passes):
    return subprocess.Popen([sys.executable, "-c", CHILD, str(recipe), str(out), str(recorded_passes)],
                            stdout=subprocess.PIPE, text=True)


def _package_state(out_dir):
    final = out_dir / "dsv41-small.b12x"
    if not final.exists():
        return "absent"
    load(final)  # raises if partial or corrupt
    return "complete"


@pytest.mark.parametrize("phase, writes", [("capturing", 0), ("writing", 0), ("writing", 5)])  # 6 files: 5 = the manifest
def test_export_killed_mid_way_leaves_no_partial_package(small_recipe, recorded_passes, tmp_path, phase, writes):
    recipe = tmp_path / "small.yaml"
    recipe.write_text(yaml.safe_dump(small_recipe.normalized()))
    out = tmp_path / "out"
    child = _child(recipe, out, recorded_passes)
    seen, reached = 0, False
    for line in child.stdout:
        if line.strip() == phase:
            seen += 1
            if seen > writes or phase == "capturing":
                reached = True
                break
    time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    assert reached, f"the child export ended before {phase} #{writes + 1} (exit status {child.returncode})"
    assert _package_state(out) == "absent"
    # Whatever was left is hidden scratch, never under the final name; a rerun succeeds.
    leftovers = [p.name for p in out.iterdir()] if out.exists() else []
    assert all(name.startswith(".dsv41-small.b12x.") for name in leftovers), leftovers
    export_package(small_recipe, out)  # in this process: only the killed export needs a child
    assert _package_state(out) == "complete"


def test_export_killed_while_replacing_keeps_the_old_package_loadable(small_recipe, recorded_passes, tmp_path):
    """Re-export over an existing package: at every moment the final name is absent or whole."""
    recipe = tmp_path / "small.yaml"
    recipe.write_text(yaml.safe_dump(small_recipe.normalized()))
    out = tmp_path / "out"
    export_package(small_recipe, out)  # in this process: only the killed export needs a child
    child = _child(recipe, out, recorded_passes)
    writing = any(line.strip() == "writing" for line in child.stdout)  # stops reading at the first write
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    assert writing, f"the child export ended before writing (exit status {child.returncode})"
    assert _package_state(out) == "complete"


def _generate(pkg, prompts, results, key):
    decoder = Decoder(pkg.session(slots=len(prompts), max_rows=4))
    results[key] = decoder.generate(prompts, 16)


def test_two_sessions_in_two_threads_match_sequential_runs(fused_pkg):
    gen = torch.Generator().manual_seed(21)
    prompts_a = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (30, 170)]
    prompts_b = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 90, 140)]
    sequential = {}
    _generate(fused_pkg, prompts_a, sequential, "a")
    _generate(fused_pkg, prompts_b, sequential, "b")
    threaded = {}
    threads = [threading.Thread(target=_generate, args=(fused_pkg, p, threaded, k))
               for k, p in (("a", prompts_a), ("b", prompts_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert threaded == sequential


LOADER = textwrap.dedent("""
    import json, sys
    from b12x_toolchain.runtime import load
    from b12x_toolchain.runtime.serving.speculative import Decoder
    pkg = load(sys.argv[1])
    print(json.dumps(Decoder(pkg.session(slots=1)).generate([[3, 1, 4, 1, 5]], 8)))
""")


def test_loading_one_package_from_several_processes_at_once(fused_path):
    children = [subprocess.Popen([sys.executable, "-c", LOADER, str(fused_path)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = []
    for child in children:
        stdout, stderr = child.communicate(timeout=600)
        assert child.returncode == 0, stderr
        outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0][0]) == 8
