"""Capture backends: what turns a bucket's step into something a replay runs.

GraphRunner does everything around a capture the same way whatever the backend: it routes
the bucket's static inputs to padding, counts the warm-up steps, keeps one replayable per
(pass, rows bucket) and checks the caller's buffer addresses before each replay. A backend
only provides the two things that differ:

    warming_up()   a context the warm-up steps run in
    record(step)   something whose replay() does what `step` does

CudaGraphCapture warms up on a side stream and records into a `torch.cuda.CUDAGraph`;
every graph of a session shares one memory pool. RecordingCapture is its stand-in off
the GPU: it records the step itself and replays it by calling it, so the CPU suite runs
the runner's capture path line for line (a session takes it as `capture=`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Protocol

import torch

from b12x_toolchain.runtime.ops import opset as ops

DISTRIBUTION = "b12x-toolchain"  # what pip installs; `b12x` on PyPI is FlashInfer's
CUDA_EXTRA = f"pip install '{DISTRIBUTION}[cuda]'"


class Replayable(Protocol):
    def replay(self) -> None: ...


class CaptureBackend(Protocol):
    def warming_up(self) -> contextlib.AbstractContextManager: ...

    def record(self, step: Callable[[], None]) -> Replayable: ...


class CudaGraphCapture:
    """CUDA graphs: warm-up on a side stream, then one graph per bucket in a shared pool.

    Sharing the pool is safe because a step keeps nothing alive past its end (results are
    copied into static outputs the session owns) and replays never overlap. `cuda` is the
    torch.cuda namespace whose streams and graphs it uses (tests hand in a recorder).
    """

    def __init__(self, device, cuda=torch.cuda):
        if not ops.CUDA_KERNELS:
            raise RuntimeError(f"a CUDA session needs the Triton kernels of op set v{ops.OPSET_VERSION}: install "
                               f"triton ({CUDA_EXTRA})")
        self.device, self.cuda = torch.device(device), cuda
        self.pool = cuda.graph_pool_handle()
        # Captured on a stream of the session's device: torch.cuda.graph's default capture
        # stream belongs to whichever device was current when it was first made, so a session
        # on cuda:1 opened while cuda:0 is current would otherwise record on the wrong device.
        self.capture_stream = cuda.Stream(self.device)

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        # Off the current stream, as capture requires of the work it records (Triton
        # compiles and cuBLAS sets up here); the current stream waits for it after.
        side = self.cuda.Stream(self.device)
        side.wait_stream(self.cuda.current_stream(self.device))
        with self.cuda.stream(side):
            yield
        self.cuda.current_stream(self.device).wait_stream(side)

    def record(self, step: Callable[[], None]) -> torch.cuda.CUDAGraph:
        graph = self.cuda.CUDAGraph(keep_graph=True)  # kept so its nodes can be inspected
        with self.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
            step()  # launches are recorded, not run
        graph.instantiate()
        return graph


class RecordedStep:
    """A recorded step: replay() runs it, and counts how often it did."""

    def __init__(self, step: Callable[[], None]):
        self.step, self.replays = step, 0

    def replay(self) -> None:
        self.replays += 1
        self.step()


class RecordingCapture:
    """The stand-in for CUDA graphs: records each step as it is and replays it by running it.

    Like a CUDA capture, recording runs nothing: only the warm-up steps touch memory
    before the first replay. It keeps what it saw, so tests can count warm-ups and replays.
    """

    def __init__(self):
        self.warm_ups = 0  # warming_up() blocks entered
        self.recorded: list[RecordedStep] = []

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        self.warm_ups += 1
        yield

    def record(self, step: Callable[[], None]) -> RecordedStep:
        self.recorded.append(RecordedStep(step))
        return self.recorded[-1]
