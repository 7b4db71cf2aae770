"""The capture path of the graph runner, run off the GPU through its stand-in (RecordingCapture).

Warm-up, capture bookkeeping, buffer checks and replay are the runner's own code whatever
the backend, so they run here with the stand-in as they run on a GPU with CUDA graphs.
Warm-up really runs a pass: it must touch only the scratch slot and no page, or a session
preparing its graphs would overwrite the caches of requests that are already live.
"""

from __future__ import annotations

import contextlib
import tomllib
from pathlib import Path

import pytest
import torch

from b12x_toolchain.runtime.serving.speculative import Decoder
from b12x_toolchain.runtime.session.capture import CudaGraphCapture, RecordedStep, RecordingCapture
from b12x_toolchain.runtime.session.graph_runner import WARMUP_STEPS, ForeignBufferError, GraphRunner
from b12x_toolchain.runtime.session.session import Session
from conftest import random_tokens

SCRATCH = 9


class SlotBucket:
    """A bucket whose step adds one to its cache row of every row's slot, and remembers the
    static inputs each run saw: enough to tell where warm-up and replays write."""

    def __init__(self, rows, cache, live_slot=3, log=None):
        self.rows, self.cache, self.log = rows, cache, log
        self.inputs = {"slots": torch.full((rows,), live_slot, dtype=torch.int32, device=cache.device),
                       "table": torch.full((rows, 2), 5, dtype=torch.int32, device=cache.device)}
        self.padding = {"slots": SCRATCH, "table": -1}
        self.outputs = {"out": torch.zeros(rows, device=cache.device)}
        self.seen = []

    def run(self):
        if self.log is not None:
            self.log.append("step")
        self.seen.append({name: t.clone() for name, t in self.inputs.items()})  # no host sync: CUDA captures this
        index = self.inputs["slots"].long()
        self.cache.index_add_(0, index, torch.ones(self.rows, dtype=self.cache.dtype, device=self.cache.device))
        return {"out": self.cache[index].float()}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _capture_on(device: str):
    """The stand-in on the CPU; on CUDA, the default: CUDA graphs."""
    return RecordingCapture() if device == "cpu" else None


def _values(seen: dict) -> dict:
    return {name: t.tolist() for name, t in seen.items()}


def _runner(capture, device="cpu"):
    caches = {"c": torch.zeros(SCRATCH + 1, dtype=torch.int32, device=device)}
    return GraphRunner(device, (caches,), capture), caches


@pytest.mark.parametrize("device", DEVICES)
def test_warm_up_writes_only_the_scratch_slot_and_replays_the_rows_given(device):
    runner, caches = _runner(_capture_on(device), device)
    bucket = SlotBucket(2, caches["c"])  # its inputs still name a live slot (3) and page (5)
    runner.add("verify", bucket)
    expected = [0] * SCRATCH + [2 * WARMUP_STEPS]  # two rows, each warm-up step; capture writes nothing
    assert caches["c"].tolist() == expected
    assert bucket.inputs["slots"].tolist() == [SCRATCH] * 2 and bucket.inputs["table"].tolist() == [[-1, -1]] * 2
    bucket.inputs["slots"].copy_(torch.tensor([1, 2]))
    runner.replay("verify", bucket)
    expected[1] = expected[2] = 1
    assert caches["c"].tolist() == expected and bucket.outputs["out"].tolist() == [1.0, 1.0]


def test_the_stand_in_records_after_the_warm_up_and_replays_what_it_recorded():
    capture = RecordingCapture()
    runner, caches = _runner(capture)
    buckets = {rows: SlotBucket(rows, caches["c"]) for rows in (1, 2)}
    for bucket in buckets.values():
        runner.add("draft", bucket)
    assert capture.warm_ups == 2 and len(capture.recorded) == 2
    assert [len(b.seen) for b in buckets.values()] == [WARMUP_STEPS] * 2  # recording ran nothing
    assert all(_values(seen) == {"slots": [SCRATCH] * b.rows, "table": [[-1, -1]] * b.rows}
               for b in buckets.values() for seen in b.seen)
    graph = runner.graph("draft", 2)
    assert isinstance(graph, RecordedStep) and graph is capture.recorded[1]
    runner.replay("draft", buckets[2])
    assert graph.replays == 1 and capture.recorded[0].replays == 0 and len(buckets[2].seen) == WARMUP_STEPS + 1


def test_without_capture_nothing_runs_until_a_replay():
    runner, caches = _runner(None)
    bucket = SlotBucket(1, caches["c"])
    runner.add("commit", bucket)
    assert not runner.captures and runner.graph("commit", 1) is None and bucket.seen == []
    runner.replay("commit", bucket)
    assert [_values(seen) for seen in bucket.seen] == [{"slots": [3], "table": [[5, 5]]}]


def test_an_input_without_a_padding_value_is_refused_before_warm_up():
    runner, caches = _runner(RecordingCapture())
    bucket = SlotBucket(2, caches["c"])
    del bucket.padding["table"]
    with pytest.raises(ValueError, match=r"the 2-row bucket has no padding value for inputs \['table'\]"):
        runner.add("verify", bucket)
    assert bucket.seen == [] and caches["c"].sum() == 0


def test_capture_on_a_rebound_buffer_is_refused():
    runner, caches = _runner(RecordingCapture())
    bucket = SlotBucket(1, caches["c"])
    caches["c"] = torch.zeros(SCRATCH + 1, dtype=torch.int32)
    with pytest.raises(ForeignBufferError, match="^c: bound at"):
        runner.add("verify", bucket)
    assert bucket.seen == []


class CudaCalls:
    """Stands in for the torch.cuda namespace: the calls made of it, in order, in `log`."""

    def __init__(self):
        self.log, self.streams = [], 0

    def graph_pool_handle(self):
        self.log.append("pool handle")
        return "pool"

    def Stream(self, device):
        self.streams += 1
        return Stream(f"{device} stream {self.streams}", self.log)

    def current_stream(self, device):
        return Stream("current", self.log)

    @contextlib.contextmanager
    def stream(self, stream):
        self.log.append(f"on {stream.name}")
        yield
        self.log.append(f"off {stream.name}")

    def CUDAGraph(self, keep_graph):
        return Graph(self.log)

    @contextlib.contextmanager
    def graph(self, graph, pool, stream):
        self.log.append(f"capture into {pool} on {stream.name}")
        yield
        self.log.append("capture end")


class Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


class Graph:
    def __init__(self, log):
        self.log = log

    def instantiate(self):
        self.log.append("instantiate")

    def replay(self):
        self.log.append("replay")


def test_cuda_capture_warms_up_on_a_side_stream_then_captures_into_the_shared_pool(monkeypatch):
    from b12x_toolchain.runtime.ops import opset as ops

    monkeypatch.setattr(ops, "CUDA_KERNELS", True)
    cuda = CudaCalls()
    runner, caches = _runner(CudaGraphCapture("cuda:1", cuda=cuda))  # cuda:1: whatever device is current
    bucket = SlotBucket(1, caches["c"], log=cuda.log)
    runner.add("verify", bucket)
    runner.replay("verify", bucket)
    side = "cuda:1 stream 2"  # stream 1 is the capture stream, made with the backend
    assert cuda.log == ["pool handle", f"{side} waits for current", f"on {side}", *["step"] * WARMUP_STEPS,
                        f"off {side}", f"current waits for {side}", "capture into pool on cuda:1 stream 1", "step",
                        "capture end", "instantiate", "replay"]
    assert all(_values(seen) == {"slots": [SCRATCH], "table": [[-1, -1]]} for seen in bucket.seen)


def test_a_cuda_runner_without_the_triton_kernels_names_the_extra_to_install(monkeypatch):
    from b12x_toolchain.runtime.ops import opset as ops

    project = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]
    assert "cuda" in project["optional-dependencies"]
    monkeypatch.setattr(ops, "CUDA_KERNELS", False)
    with pytest.raises(RuntimeError, match="needs the Triton kernels") as refused:
        GraphRunner("cuda", ({},))
    assert f"pip install '{project['name']}[cuda]'" in str(refused.value)


# ---------------------------------------------------------------- through a session

SENTINEL = 0x5A


def _held_by(session, slot: int) -> dict[str, list[torch.Tensor]]:
    """Views of all a request in `slot` holds: its row of every per-slot cache, and its
    pages of every paged cache."""
    paged = {name: pool for pool, caches in session.pages.caches.items() for name in caches}
    return {name: [cache[page] for page in session.pages.held[paged[name]][slot]] if name in paged else [cache[slot]]
            for name, cache in session.caches.items()}


def _request_state(session, caches: dict | None = None) -> dict[str, torch.Tensor]:
    """What requests may hold in the session's caches (or in `caches` of their shapes): every
    page of a paged cache, the request slots' rows of the others (the scratch slot's rows are
    warm-up's and padding's to write)."""
    paged = {name for pool in session.pages.caches.values() for name in pool}
    caches = session.caches if caches is None else caches
    return {name: cache if name in paged else cache[: session.slots] for name, cache in caches.items()}


def _prepare_again(live) -> None:
    for name, buckets in live.buckets.items():
        for bucket in buckets.values():
            live.graphs.add(name, bucket)  # its static inputs still hold the rows it last replayed


def _prepare_over_its_buffers(live) -> None:
    Session(live.package, live.device, slots=live.slots, max_rows=2, buffers=dict(live.caches),
            capture=_capture_on(live.device.type))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prepare", [_prepare_again, _prepare_over_its_buffers],
                         ids=["same session again", "new session over its buffers"])
def test_preparing_graphs_leaves_a_live_requests_pages_and_slot_alone(fused_pkg, prepare, device):
    live = Session(fused_pkg, device, slots=2, max_rows=2, capture=_capture_on(device))
    Decoder(live).prefill(0, random_tokens(torch.Generator().manual_seed(3), 40))
    assert all(live.pages.held[pool][0] for pool in live.pools), "the request should hold pages of every pool"
    held = _held_by(live, 0)
    for views in held.values():
        for view in views:
            view.fill_(SENTINEL)
    prepare(live)
    changed = [name for name, views in held.items() if not all(bool((v == SENTINEL).all()) for v in views)]
    assert changed == [], f"preparing graphs wrote the live request's {changed}"


def test_every_bucket_is_recorded_and_warm_up_touches_only_the_scratch_slot(fused_pkg):
    """The CPU twin of test_cuda_session's capture test: caches full of a caller's data."""
    gen = torch.Generator().manual_seed(1)
    probe = Session(fused_pkg, slots=2, max_rows=2)
    caches = {name: torch.randint(0, 100, cache.shape, generator=gen).to(cache.dtype) for name, cache in
              probe.caches.items()}
    before = {name: cache.clone() for name, cache in caches.items()}
    capture = RecordingCapture()
    session = Session(fused_pkg, slots=2, max_rows=2, buffers=caches, capture=capture)
    recorded = [session.graphs.graph(name, rows) for name, buckets in session.buckets.items() for rows in buckets]
    assert recorded == capture.recorded and capture.warm_ups == len(recorded) == 2 * len(fused_pkg.passes)
    before, after = _request_state(session, before), _request_state(session)
    assert [name for name in after if not torch.equal(after[name], before[name])] == []


def test_replays_through_recorded_steps_decode_what_direct_replays_decode(fused_pkg):
    prompts = [random_tokens(torch.Generator().manual_seed(5), n) for n in (12, 30)]
    tokens, states = [], []
    for capture in (None, RecordingCapture()):
        session = Session(fused_pkg, slots=2, max_rows=2, capture=capture)
        tokens.append(Decoder(session).generate(prompts, max_new_tokens=6))
        states.append(_request_state(session))
    assert tokens[0] == tokens[1]
    assert [name for name in states[0] if not torch.equal(states[0][name], states[1][name])] == []
