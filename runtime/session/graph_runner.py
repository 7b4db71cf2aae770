"""Graph replay per (pass, rows bucket): captured once on CUDA, run directly on the CPU.

A step of a bucket is "run the pass graph on the bucket's fixed argument list, copy its
results into the bucket's static outputs". On CUDA each bucket's step is warmed up on a
side stream (Triton compiles, cuBLAS sets up) and captured once into a CUDA graph; all
graphs share one memory pool, which is safe because a step keeps nothing alive past its
end (results are copied into static outputs the session owns) and replays never overlap.
A replay is then one `graph.replay()`: no host work beyond the caller's input copies.
On the CPU the same bookkeeping runs the step directly.

A captured graph holds raw addresses. If the caller rebinds a cache or staging buffer
after the session was prepared, the graph would keep writing the old memory while the
caller reads the new one; so every replay first compares the data pointers of the
caller-owned buffers with those seen at capture (one pointer read per buffer) and
refuses to run on a foreign buffer.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from b12x_toolchain.runtime.ops import opset as ops
from b12x_toolchain.runtime.session.validate import BufferError

WARMUP_STEPS = 2  # the first compiles and autotunes; the second runs what capture records


class ForeignBufferError(BufferError):
    """A caller-owned buffer is not the one the session's graphs were captured with."""


def step(bucket) -> None:
    result = bucket.run()
    for name, out in bucket.outputs.items():
        out.copy_(result[name])


class GraphRunner:
    def __init__(self, device, owned: Sequence[Mapping[str, torch.Tensor]], scratch_slot: int):
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda"
        if self.capture and not ops.CUDA_KERNELS:
            raise RuntimeError(f"a CUDA session needs the Triton kernels of op set v{ops.OPSET_VERSION}: install triton "
                               "(pip install 'b12x[cuda]')")
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.scratch_slot = scratch_slot
        self._owned = owned
        self._names = [name for mapping in owned for name in mapping]
        self._pointers = self._current()
        self._buckets: dict[str, dict[int, object]] = {}
        self._graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}

    def _current(self) -> list[int]:
        return [t.data_ptr() for mapping in self._owned for t in mapping.values()]

    # -- preparation ------------------------------------------------------------------

    def add(self, pass_name: str, bucket) -> None:
        """Take a prepared bucket; on CUDA, warm it up and capture its step."""
        self._buckets.setdefault(pass_name, {})[bucket.rows] = bucket
        if self.capture:
            self._graphs[(pass_name, bucket.rows)] = self._capture(bucket)

    def _capture(self, bucket) -> torch.cuda.CUDAGraph:
        # Warm-up really runs the pass: point every row at the scratch slot so that no
        # request's cache changes (staging, inputs and outputs are reusable anyway).
        slots = getattr(bucket, "slot_input", None)  # the input of kind slot_ids (session.Bucket)
        if slots in bucket.inputs:
            bucket.inputs[slots].fill_(self.scratch_slot)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                step(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph(keep_graph=True)  # kept so its nodes can be inspected
        with torch.cuda.graph(graph, pool=self.pool):
            step(bucket)
        graph.instantiate()
        return graph

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

    def graph(self, pass_name: str, rows: int) -> torch.cuda.CUDAGraph | None:
        """The captured graph of a bucket (None on the CPU), e.g. to count its nodes."""
        return self._graphs.get((pass_name, rows))
