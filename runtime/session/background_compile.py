"""Compiled replay without waiting: a session compiles its buckets off the serving thread.

A session opened with `compile_in_background` replays its plain graphs from its first
request while a child process compiles every (pass, rows bucket) of its compiled passes
into the local cache (compile_worker.py says why not a thread) and a worker thread then loads
them (compiled.py). When all of them have compiled, `swap_in()` switches every bucket at once;
the engine calls it between steps while no request is in flight. One switch, not one per
bucket as it finishes: compiled and plain replays round differently (compiled.py), and a
request's tokens must come from one or the other, or a decode and a verify of the same token
would no longer agree to the bit and speculative text could part from greedy text.

Each bucket's compilation is kept in the session's local compile cache; once all have
compiled, a record of that set (the passes, buckets and argument shapes, with a digest of
the runtime's code) is written beside them. A session that opens on a cache holding that
record, after a restart or after `b12x compile`, loads every bucket from the cache before its
first request (seconds, not minutes) and replays compiled from the start.

A compilation that fails leaves the session on its plain graphs, which stay correct; the
error is kept for `status()` (and the server's /metrics).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import traceback
from pathlib import Path

import torch

from b12x_toolchain.runtime.session.compiled import CompiledGraph, runtime_digest


def compile_key(buckets: list[tuple[str, object]]) -> str:
    """What the compiled set depends on besides the package, device and torch (the directory's
    key): each bucket's pass, rows and argument shapes and dtypes, and the runtime's code."""
    parts = [[name, bucket.rows, [[list(a.shape), str(a.dtype)] for a in bucket.args]] for name, bucket in buckets]
    return hashlib.sha256(json.dumps([parts, runtime_digest()]).encode()).hexdigest()[:32]


class BackgroundCompile:
    def __init__(self, buckets: list[tuple[str, object]], directory: Path, graph_of, recapture=None,
                 device: torch.device | None = None):
        """buckets: (pass name, Bucket) pairs to compile; directory: the compile cache (compiled.cache_dir);
        graph_of(pass name): the pass's graph, built on the worker
        thread (the replay graph: Inductor traces it afresh, and torch's caches key it by its
        code, which the package's full program shares, so reading that program is not needed). recapture(pass name, bucket): called
        after a swap where the session captures its buckets (CUDA graphs hold the plain kernels)."""
        self.buckets, self.directory, self._recapture = buckets, Path(directory), recapture
        self._graph_of, self.device = graph_of, device
        self.compiled: dict[tuple[str, int], CompiledGraph] = {}
        self.record = self.directory / f"compiled-{compile_key(buckets)}.json"
        self.done, self.swapped, self._stop = threading.Event(), False, threading.Event()
        self.error: str | None = None

    @property
    def cached(self) -> bool:
        """Whether the local cache holds every bucket of this set (a complete earlier compilation)."""
        return self.record.is_file()

    def compile_now(self) -> bool:
        """Compile (or load from the cache) every bucket on this thread and swap them in; False
        when a compilation failed (the plain graphs stay, the error in status())."""
        self._compile_all()
        return self.swap_in()

    def start(self, child_spec: dict | None = None) -> None:
        """Compile on a worker thread: in a child process when `child_spec` says how to open the
        session there (compile_worker.py), the thread then only loading the results; else itself."""
        target = self._compile_all if child_spec is None else lambda: self._via_child(child_spec)
        threading.Thread(target=target, name="b12x-compile", daemon=True).start()

    def _via_child(self, spec: dict) -> None:
        from b12x_toolchain.runtime.session.compile_worker import run_child

        try:
            status, errors = run_child(spec)
            failure = None if status == 0 else f"the compiling process exited with {status}: {errors}"
        except OSError as exc:  # not started at all: as failed as a child that exited badly
            failure = f"the compiling process could not start: {exc}"
        if failure is not None:
            self.error = failure
            self.done.set()
            return
        self._compile_all()  # from the cache the child filled: loads, no tracing

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the compilation ended (finished or failed); True when it did within `timeout`."""
        return self.done.wait(timeout)

    def stop(self) -> None:
        """Compile no further bucket (the one under way finishes); for a session that closes."""
        self._stop.set()

    def _compile_all(self) -> None:
        try:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread: Triton compiles for it
            graphs = {}
            with torch.no_grad():  # grad mode is per thread; the serving thread runs without it too
                for name, bucket in self.buckets:
                    if self._stop.is_set():
                        self.error = "stopped before every pass graph compiled"
                        return
                    graphs[name] = graphs.get(name) or self._graph_of(name)
                    compiled = CompiledGraph(graphs[name], self.directory)
                    compiled.compile(bucket.args)
                    self.compiled[(name, bucket.rows)] = compiled
            if self.cached:  # written by the child that compiled these (compile_worker.py)
                return
            self.record.parent.mkdir(parents=True, exist_ok=True)
            partial = self.record.with_suffix(f".{os.getpid()}.partial")  # a reader sees all of it or none
            partial.write_text(json.dumps({"buckets": sorted(f"{n}/{r}" for n, r in self.compiled)}))
            os.replace(partial, self.record)
        except Exception as exc:  # the plain graphs stay: correct, only slower
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
        finally:
            self.done.set()

    def swap_in(self) -> bool:
        """Replay every bucket compiled from now on, if all have compiled; True when this call switched.
        Only between steps with no request in flight (the engine's step does this)."""
        if self.swapped or not self.done.is_set() or self.error is not None:
            return False
        for name, bucket in self.buckets:
            bucket.graph = self.compiled[(name, bucket.rows)]
            if self._recapture is not None:
                self._recapture(name, bucket)
        self.swapped = True
        return True

    def status(self) -> dict:
        """state: compiling, ready (compiled, waiting for an idle step), compiled or failed; counts of buckets."""
        state = "failed" if self.error else "compiled" if self.swapped else "ready" if self.done.is_set() \
            else "compiling"
        return {"state": state, "buckets": len(self.buckets), "compiled": len(self.compiled), "error": self.error}
