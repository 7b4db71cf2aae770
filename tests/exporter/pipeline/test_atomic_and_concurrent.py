"""Killed exports leave no partial package; sessions and loads work concurrently."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

import pytest
import torch

from b12x_toolchain.exporter.pipeline import package_writer
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.speculative import Decoder

pytestmark = pytest.mark.slow(minutes=0.4)  # the module's time on two busy cores: longest runs first

# The child, forked from this process, exports the small recipe; fsync is slowed so the kill
# can land mid-write, and it announces each phase on a pipe so the parent knows what it
# interrupted. Forked after `traced` exported the recipe here, it copies this process's
# traces (trace_cache.py) instead of tracing the passes again: what is killed is the writing.
FORK = multiprocessing.get_context("fork")


def _export_announcing(recipe, out, announce):
    def slow_fsync(fd, real_fsync=os.fsync):
        announce.send("writing")
        time.sleep(0.3)
        real_fsync(fd)

    package_writer.os.fsync = slow_fsync  # in the child only: the parent's module is its own copy
    announce.send("capturing")
    export_package(recipe, out)
    announce.send("done")


@pytest.fixture(scope="module")
def traced(small_recipe, tmp_path_factory):
    """The small recipe exported once in this process, so that every export after it copies its traces."""
    return export_package(small_recipe, tmp_path_factory.mktemp("traced") / "out").path


def _child(recipe, out):
    """The child export and the parent's end of its pipe."""
    phases, announce = FORK.Pipe(duplex=False)
    child = FORK.Process(target=_export_announcing, args=(recipe, out, announce))
    child.start()
    announce.close()
    return child, phases


def _phases(phases):
    while True:
        try:
            yield phases.recv()
        except EOFError:
            return


def _kill(child):
    child.kill()
    child.join(timeout=60)


def _package_state(out_dir):
    final = out_dir / "dsv41-small.b12x"
    if not final.exists():
        return "absent"
    load(final)  # raises if partial or corrupt
    return "complete"


@pytest.mark.parametrize("phase, writes", [("capturing", 0), ("writing", 0), ("writing", 5)])  # 6 files: 5 = the manifest
def test_export_killed_mid_way_leaves_no_partial_package(small_recipe, traced, tmp_path, phase, writes):
    out = tmp_path / "out"
    child, phases = _child(small_recipe, out)
    seen, reached = 0, False
    for line in _phases(phases):
        if line == phase:
            seen += 1
            if seen > writes or phase == "capturing":
                reached = True
                break
    time.sleep(0.05)
    _kill(child)
    assert reached, f"the child export ended before {phase} #{writes + 1} (exit status {child.exitcode})"
    assert _package_state(out) == "absent"
    # Whatever was left is hidden scratch, never under the final name; a rerun succeeds.
    leftovers = [p.name for p in out.iterdir()] if out.exists() else []
    assert all(name.startswith(".dsv41-small.b12x.") for name in leftovers), leftovers
    export_package(small_recipe, out)
    assert _package_state(out) == "complete"


def test_export_killed_while_replacing_keeps_the_old_package_loadable(small_recipe, traced, tmp_path):
    """Re-export over an existing package: at every moment the final name is absent or whole."""
    out = tmp_path / "out"
    export_package(small_recipe, out)
    child, phases = _child(small_recipe, out)
    writing = any(line == "writing" for line in _phases(phases))  # stops reading at the first write
    _kill(child)
    assert writing, f"the child export ended before writing (exit status {child.exitcode})"
    assert _package_state(out) == "complete"


def _generate(pkg, prompts, results, key):
    decoder = Decoder(pkg.session(slots=len(prompts), max_rows=4))
    results[key] = decoder.generate(prompts, 16)


def test_two_sessions_in_two_threads_match_sequential_runs(small_pkg):
    gen = torch.Generator().manual_seed(21)
    prompts_a = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (30, 170)]
    prompts_b = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 90, 140)]
    sequential = {}
    _generate(small_pkg, prompts_a, sequential, "a")
    _generate(small_pkg, prompts_b, sequential, "b")
    threaded = {}
    threads = [threading.Thread(target=_generate, args=(small_pkg, p, threaded, k))
               for k, p in (("a", prompts_a), ("b", prompts_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert threaded == sequential


def _load_and_generate(path, results):
    pkg = load(path)
    results.send(Decoder(pkg.session(slots=1)).generate([[3, 1, 4, 1, 5]], 8))


def test_loading_one_package_from_several_processes_at_once(small_path):
    pipes = [FORK.Pipe(duplex=False) for _ in range(3)]
    children = [FORK.Process(target=_load_and_generate, args=(small_path, sender)) for _, sender in pipes]
    for child, (_, sender) in zip(children, pipes):
        child.start()
        sender.close()  # the child holds its own end: a child that dies unheard is an EOF at once
    outputs = []
    for child, (receiver, _) in zip(children, pipes):
        assert receiver.poll(600), f"a loading process sent nothing (exit status {child.exitcode})"
        outputs.append(receiver.recv())
        child.join(timeout=60)
        assert child.exitcode == 0
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0][0]) == 8
