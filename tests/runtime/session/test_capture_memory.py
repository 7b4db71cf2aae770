"""What capture takes on CUDA (memory.py): the graph pool and the kernels' workspaces are read
around each capture and added up; a session that took more than its share, or ran out of
memory capturing, says by how many bytes it does not fit. The readings are faked here: the
accounting is the runner's and memory.py's own code whatever the device."""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.session import memory
from b12x_toolchain.runtime.session.capture import RecordingCapture
from b12x_toolchain.runtime.session.graph_runner import GraphRunner
from b12x_toolchain.runtime.session.memory import DeviceMemory, SessionMemoryError

GIB = 1 << 30
CUDA = torch.device("cuda", 0)


class Bucket:
    """The least a runner captures: a step that writes its one output."""

    def __init__(self, rows, run=None):
        self.rows, self.inputs, self.padding = rows, {}, {}
        self.outputs = {"out": torch.zeros(rows)}
        self.run = run or (lambda: {"out": torch.ones(rows)})


class Readings:
    """A fake device: each capture takes `pool` bytes into the allocator and `workspace` beside it."""

    def __init__(self, free: int, pool: int, workspace: int):
        self.free, self.reserved, self.pool, self.workspace = free, 0, pool, workspace
        self.read = 0

    def __call__(self, device) -> DeviceMemory:
        self.read += 1
        return DeviceMemory(self.free, self.reserved)

    def capture(self):
        self.reserved += self.pool
        self.free -= self.pool + self.workspace


def test_a_capture_takes_the_allocators_growth_as_pool_and_the_rest_as_workspace():
    before, after = DeviceMemory(10 * GIB, GIB), DeviceMemory(7 * GIB, 3 * GIB)
    assert memory.capture_taken(before, after) == {"graph_pool_bytes": 2 * GIB, "workspace_bytes": GIB}
    # Freed memory (another process let go) is not a negative cost.
    assert memory.capture_taken(after, before) == {"graph_pool_bytes": 0, "workspace_bytes": 0}


def test_the_runner_adds_up_what_each_capture_took():
    readings = Readings(free=20 * GIB, pool=3 << 20, workspace=1 << 20)
    capture = RecordingCapture()
    runner = GraphRunner("cpu", ({},), capture, measure=readings)
    original = capture.record
    capture.record = lambda step: (readings.capture(), original(step))[1]
    for rows in (1, 2, 4):
        runner.add("verify", Bucket(rows))
    assert readings.read == 6 and runner.capture_memory == {"graph_pool_bytes": 9 << 20, "workspace_bytes": 3 << 20}


def test_no_reading_off_cuda_by_default():
    runner = GraphRunner("cpu", ({},), RecordingCapture())
    runner.add("verify", Bucket(1))
    assert runner._measure is None and runner.capture_memory == {"graph_pool_bytes": 0, "workspace_bytes": 0}


def test_running_out_of_memory_capturing_says_by_how_much_and_what_to_change():
    readings = Readings(free=GIB, pool=256 << 20, workspace=0)

    def run():
        readings.capture()  # the pool grew before the allocation that failed
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total "
                                          "capacity of 79.19 GiB of which 768.00 MiB is free.\nmore lines")

    runner = GraphRunner("cpu", ({},), RecordingCapture(), measure=readings)
    with pytest.raises(SessionMemoryError) as refused:
        runner.add("prefill", Bucket(8, run))
    message = str(refused.value)
    short = (3 << 29) - (GIB - (256 << 20))  # 1.5 GiB asked, 768 MiB free
    assert message.startswith(f"capturing pass prefill's 8-row bucket on cpu ran out of device memory: the session "
                              f"does not fit by at least {short} bytes (capture had taken {256 << 20} bytes of graph "
                              f"pool and 0 bytes of workspaces; the default budget leaves {GIB} bytes for them). "
                              "Give fewer pages, a smaller cache_bytes or fewer slots, or lower memory_fraction")
    assert message.endswith("(torch: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of "
                            "79.19 GiB of which 768.00 MiB is free.)")
    assert isinstance(refused.value, ValueError) and "\n" not in message


def test_an_out_of_memory_message_without_a_size_still_names_what_is_free():
    error = memory.capture_out_of_memory("pass verify's 1-row bucket", CUDA, {"graph_pool_bytes": 0,
                                         "workspace_bytes": 0}, 5, torch.cuda.OutOfMemoryError(""))
    assert "does not fit by more than the 5 bytes still free" in str(error) and "(torch: OutOfMemoryError)" in str(error)


def _budget(free=80 * GIB, fraction=0.9):
    return {"memory_fraction": fraction, "free_bytes": free, "other_bytes": GIB, "budget_bytes": 0,
            "capture_headroom_bytes": memory.CAPTURE_HEADROOM_BYTES}


def test_a_session_within_its_share_records_what_capture_took():
    taken = {"graph_pool_bytes": 300 << 20, "workspace_bytes": 200 << 20}
    budget = _budget()
    free_now = budget["free_bytes"] - int(0.9 * budget["free_bytes"])  # took its share to the byte
    record = memory.after_capture(budget, taken, free_now, CUDA)
    assert record == budget | taken | {"used_bytes": int(0.9 * budget["free_bytes"])}
    # Pools the caller sized: nothing to keep to, only the measurement.
    assert memory.after_capture(None, taken, 0, CUDA) == taken


def test_a_session_whose_capture_outgrew_the_headroom_says_by_how_much_it_does_not_fit():
    taken = {"graph_pool_bytes": 2 * GIB, "workspace_bytes": 512 << 20}
    budget = _budget()
    allowed = int(0.9 * budget["free_bytes"])
    over = 1_500_000_000
    with pytest.raises(SessionMemoryError) as refused:
        memory.after_capture(budget, taken, budget["free_bytes"] - allowed - over, CUDA)
    assert str(refused.value) == (
        f"the session does not fit on cuda:0 by {over} bytes: it took {allowed + over} bytes, more than "
        f"memory_fraction 0.9 of the {80 * GIB} bytes free when it opened ({allowed} bytes), because capture took "
        f"{2 * GIB} bytes of graph pool and {512 << 20} bytes of workspaces against the {GIB} bytes left for them. "
        f"Give fewer pages, a smaller cache_bytes or fewer slots (at least {over} bytes less), or raise "
        "memory_fraction")


def test_only_cuda_leaves_headroom_for_capture():
    assert memory.capture_headroom(CUDA) == memory.CAPTURE_HEADROOM_BYTES > 0
    assert memory.capture_headroom(torch.device("cpu")) == 0
