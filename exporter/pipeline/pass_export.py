"""Capture, rewrite and serialise one pass; several passes at once in worker processes.

Passes are independent captures, each in its own fake mode and shape environment, so
their bytes do not depend on where or in which order they run: exporting with several
jobs gives the same package as one job. Tracing a full-size pass takes tens of seconds
of single-threaded Python, so on a machine with two cores two jobs roughly halve a
structural export. Workers are spawned (not forked) because torch's thread pools do not
survive a fork, and each job carries only the recipe, so a worker needs nothing else.
"""

from __future__ import annotations

import multiprocessing
import resource
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from b12x_toolchain.exporter.errors import ExportError
from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.pipeline.capture import capture
from b12x_toolchain.exporter.pipeline.package_writer import program_bytes
from b12x_toolchain.exporter.pipeline.rank_group import rank_group
from b12x_toolchain.exporter.pipeline.structural import fake_weights
from b12x_toolchain.exporter.pipeline.trace_cache import trace_key, traced
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.views.pass_dump import PassDump
from b12x_toolchain.passes.pipeline import rewrites_named
from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.parallel.group import collective_counts
from b12x_toolchain.runtime.rewrite import RewriteError, RewriteResult, run_rewrites


def pass_label(name: str, rank: int | None) -> str:
    """How a job and its output are named: the pass, and its rank in a parallel export."""
    return name if rank is None else f"{name} (rank {rank})"


@dataclass
class PassJob:
    recipe: object
    name: str
    rewrites: list[str]  # names of the rewrites to run, in order
    weights: dict | None  # None: structural (fake weights, made where the pass is captured)
    dump_dir: Path | None
    rank: int | None = None  # of a parallel recipe's ranks (None: one device)

    @property
    def label(self) -> str:
        return pass_label(self.name, self.rank)


@dataclass
class PassOutput:
    name: str
    graph: bytes
    records: list[RewriteResult]
    inputs: list[BufferSpec]
    outputs: list[BufferSpec]
    seconds: float  # wall time: capture, rewrites, serialisation
    cpu_seconds: float  # CPU time of the same: what a busy machine does not inflate
    peak_rss_bytes: int  # of the process that exported the pass, up to its end
    rank: int | None = None
    collectives: dict | None = None  # collective -> how many the graph issues

    @property
    def label(self) -> str:
        return pass_label(self.name, self.rank)


def export_pass(job: PassJob) -> PassOutput:

    started, cpu_started = time.perf_counter(), time.process_time()
    d = Dims.from_recipe(job.recipe)
    module = PASSES[job.name](d, job.rank or 0)
    inputs, outputs = module.convention()
    weights = fake_weights(d) if job.weights is None else job.weights
    with rank_group(d, job.rank):
        program = traced(trace_key(d, job.name, job.rank, weights), lambda: capture(module, weights))
    dump_dir = job.dump_dir if job.rank is None or job.dump_dir is None else job.dump_dir / f"rank{job.rank}"
    dump = PassDump(dump_dir) if dump_dir is not None else None
    records = []
    try:
        if dump is not None:
            dump.write(job.name, 0, "captured", program.graph_module, inputs, outputs)
        # One rewrite at a time, so the graph can be dumped after each.
        for i, rewrite in enumerate(rewrites_named(job.rewrites), 1):
            records += run_rewrites(program.graph_module, [rewrite], job.name)
            if dump is not None:
                dump.write(job.name, i, rewrite.name, program.graph_module, inputs, outputs)
    except RewriteError as exc:
        raise ExportError(str(exc)) from exc
    graph = program_bytes(program)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return PassOutput(job.name, graph, records, inputs, outputs, time.perf_counter() - started,
                      time.process_time() - cpu_started, peak, job.rank, collective_counts(program.graph))


def run_jobs(jobs: list[PassJob], workers: int, on_start: Callable[[str], None] | None = None,
             on_done: Callable[[PassOutput], None] | None = None) -> dict[str, PassOutput]:
    """Run every job, `workers` at a time (1: in this process); results by job label.

    A job is handed to a worker only when one is free, so `on_start` fires when a pass
    really starts. The first failure cancels what has not started and is raised.
    """
    results = {}
    if workers <= 1:
        for job in jobs:
            if on_start is not None:
                on_start(job.label)
            results[job.label] = output = export_pass(job)
            if on_done is not None:
                on_done(output)
        return results
    pending, running = list(jobs), {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            while pending or running:
                while pending and len(running) < workers:
                    job = pending.pop(0)
                    if on_start is not None:
                        on_start(job.label)
                    running[pool.submit(export_pass, job)] = job.label
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    running.pop(future)
                    output = future.result()
                    results[output.label] = output
                    if on_done is not None:
                        on_done(output)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return results
