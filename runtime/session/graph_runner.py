"""Graph replay per (pass, rows bucket): captured once on CUDA, run directly on the CPU.

A step of a bucket is "run the pass graph on the bucket's fixed argument list, copy its
results into the bucket's static outputs". With a capture backend (capture.py; CUDA
graphs by default on a CUDA device) each bucket's step is warmed up and captured once,
and a replay is then one `replay()` of what was captured: no host work beyond the
caller's input copies. Without one (the CPU's default) a replay runs the step directly.

Warm-up really runs the pass, on whatever the bucket's static inputs hold. So before it,
every row of them is set to the value of a padding row (the bucket's `padding`, chosen by
input kind: the scratch slot, no page, zero), and no request's cache or page changes.

A captured graph holds raw addresses. If the caller rebinds a cache or staging buffer
after the session was prepared, the graph would keep writing the old memory while the
caller reads the new one; so every replay first compares the data pointers of the
caller-owned buffers with those seen at capture (one pointer read per buffer) and
refuses to run on a foreign buffer.

On a CUDA device the runner reads the device's memory around each capture and adds what it
took to `capture_memory` (memory.py: the graph pool and the kernels' workspaces, which no
budget can know beforehand); a capture that runs out of device memory is a
SessionMemoryError saying by how much the session does not fit.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from b12x_toolchain.runtime.session.capture import CaptureBackend, CudaGraphCapture, Replayable
from b12x_toolchain.runtime.session.memory import capture_out_of_memory, capture_taken, device_memory
from b12x_toolchain.runtime.session.validate import BufferError

WARMUP_STEPS = 2  # the first compiles and autotunes; the second runs what capture records


class ForeignBufferError(BufferError):
    """A caller-owned buffer is not the one the session's graphs were captured with."""


def step(bucket) -> None:
    result = bucket.run()
    for name, out in bucket.outputs.items():
        out.copy_(result[name])


def route_to_padding(bucket) -> None:
    """Set every row of the bucket's static inputs to its padding value (bucket.padding,
    by input kind), so that running the step touches only the scratch slot and no page."""
    missing = sorted(set(bucket.inputs) - set(bucket.padding))
    if missing:
        raise ValueError(f"the {bucket.rows}-row bucket has no padding value for inputs {missing}; "
                         "warm-up would run them on whatever rows they hold")
    for name, static in bucket.inputs.items():
        static.fill_(bucket.padding[name])


def default_capture(device: torch.device) -> CaptureBackend | None:
    """CUDA graphs on a CUDA device; elsewhere replays run the step directly."""
    return CudaGraphCapture(device) if device.type == "cuda" else None


class GraphRunner:
    def __init__(self, device, owned: Sequence[Mapping[str, torch.Tensor]], capture: CaptureBackend | None = None,
                 measure=None):
        """capture: the backend that captures each bucket's step (capture.py); by default
        CUDA graphs on a CUDA device and none elsewhere. measure(device) reads the device's
        memory around each capture (memory.device_memory by default on a CUDA device, nothing
        elsewhere; tests hand in a fake)."""
        self.device = torch.device(device)
        self.backend = capture if capture is not None else default_capture(self.device)
        self._measure = measure if measure is not None else device_memory if self.device.type == "cuda" else None
        self.capture_memory = {"graph_pool_bytes": 0, "workspace_bytes": 0}  # summed over captures
        self._owned = owned
        self._names = [name for mapping in owned for name in mapping]
        self._pointers = self._current()
        self._buckets: dict[str, dict[int, object]] = {}
        self._graphs: dict[tuple[str, int], Replayable] = {}

    @property
    def captures(self) -> bool:
        return self.backend is not None

    def _current(self) -> list[int]:
        return [t.data_ptr() for mapping in self._owned for t in mapping.values()]

    # -- preparation ------------------------------------------------------------------

    def add(self, pass_name: str, bucket) -> None:
        """Take a prepared bucket; with a capture backend, warm it up and capture its step."""
        self._buckets.setdefault(pass_name, {})[bucket.rows] = bucket
        if self.captures:
            self._graphs[(pass_name, bucket.rows)] = self._measured(pass_name, bucket)

    def recapture(self, pass_name: str, bucket) -> None:
        """Capture a prepared bucket again, after its graph changed (background_compile.py's swap)."""
        self._graphs[(pass_name, bucket.rows)] = self._measured(pass_name, bucket)

    def _measured(self, pass_name: str, bucket) -> Replayable:
        """_capture, with what it took added to capture_memory; running out of device memory
        says by how much the session does not fit (memory.py), not only that an allocation failed."""
        if self._measure is None:
            return self._capture(bucket)
        before = self._measure(self.device)
        try:
            graph = self._capture(bucket)
        except torch.cuda.OutOfMemoryError as exc:
            after = self._measure(self.device)
            raise capture_out_of_memory(f"pass {pass_name}'s {bucket.rows}-row bucket", self.device,
                                        self._add_taken(before, after), after.free, exc) from exc
        self._add_taken(before, self._measure(self.device))
        return graph

    def _add_taken(self, before, after) -> dict[str, int]:
        for key, value in capture_taken(before, after).items():
            self.capture_memory[key] += value
        return self.capture_memory

    def _capture(self, bucket) -> Replayable:
        self.check_buffers()  # a graph captured on a rebound buffer would fail every later check
        route_to_padding(bucket)  # warm-up really runs the pass: on the scratch slot, no page
        with self.backend.warming_up():
            for _ in range(WARMUP_STEPS):
                step(bucket)
        return self.backend.record(lambda: step(bucket))

    # -- replay -----------------------------------------------------------------------

    def bucket_for(self, pass_name: str, rows: int):
        """The smallest prepared bucket of this pass that holds `rows` rows."""
        buckets = self._buckets.get(pass_name)
        if not buckets:
            raise ValueError(f"pass {pass_name!r} has no prepared buckets")
        for size in sorted(buckets):
            if size >= rows:
                return buckets[size]
        raise ValueError(f"pass {pass_name}: {rows} rows exceed the largest prepared bucket {max(buckets)}")

    def check_buffers(self) -> None:
        """Refuse if any caller-owned buffer is not the one bound when the graphs were prepared."""
        current = self._current()
        if current == self._pointers:
            return
        names = [name for mapping in self._owned for name in mapping]
        if names != self._names:
            added, gone = sorted(set(names) - set(self._names)), sorted(set(self._names) - set(names))
            raise ForeignBufferError(f"the session's buffers changed: added {added}, removed {gone}; "
                                     "buffers are fixed when a session is prepared")
        for name, was, now in zip(names, self._pointers, current):
            if was != now:
                raise ForeignBufferError(
                    f"{name}: bound at 0x{was:x} when the session was prepared, now 0x{now:x}; the "
                    "prepared graphs write the original buffer. Write into it in place, or open a new "
                    "session with the new buffer")

    def replay(self, pass_name: str, bucket) -> None:
        """Run one step of a prepared bucket (its static inputs already hold the values)."""
        if self._buckets.get(pass_name, {}).get(bucket.rows) is not bucket:
            raise ValueError(f"pass {pass_name}: the {bucket.rows}-row bucket given is not one this runner prepared")
        self.check_buffers()
        graph = self._graphs.get((pass_name, bucket.rows))
        if graph is None:
            step(bucket)
        else:
            graph.replay()

    def graph(self, pass_name: str, rows: int) -> Replayable | None:
        """The captured graph of a bucket (None without capture), e.g. to count its nodes."""
        return self._graphs.get((pass_name, rows))
