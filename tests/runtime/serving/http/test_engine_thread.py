"""`b12x serve` prepares its session on the engine loop's thread, which replays it: a CUDA
graph, the current device and the current stream are per thread, so a graph captured on
the main thread and replayed on the engine thread would launch on another stream. The
capture path runs here through RecordingCapture, which notes the threads; a session that
cannot open raises from Service(...) in its caller, and no engine thread is left running."""

from __future__ import annotations

import threading

import pytest

from b12x_toolchain.runtime.serving.http.service import Service
from b12x_toolchain.runtime.session.capture import RecordingCapture
from b12x_toolchain.runtime.session.device import DeviceError
from http_serving import client, serve_options, start_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ThreadCapture(RecordingCapture):
    """RecordingCapture that notes the thread of every warm-up, capture and replay."""

    def __init__(self):
        super().__init__()
        self.threads = {"warm-up": set(), "capture": set(), "replay": set()}

    def warming_up(self):
        self.threads["warm-up"].add(threading.current_thread())
        return super().warming_up()

    def record(self, step):
        self.threads["capture"].add(threading.current_thread())

        def replayed():
            self.threads["replay"].add(threading.current_thread())
            step()

        return super().record(replayed)


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "b12x-engine-loop"]


def test_every_bucket_is_captured_on_the_thread_that_replays_it(small_path):
    capture = ThreadCapture()
    server = start_server(small_path, slots=1, capture=capture)
    try:
        done = client(server).completions.create(model="dsv41-small", prompt=[3, 1, 4, 1, 5], max_tokens=3)
        assert len(done.choices[0].token_ids) == 3
    finally:
        server.shutdown()
    loop = server.service.loop._thread
    assert sum(step.replays for step in capture.recorded) > 0, "the request replayed no captured step"
    assert capture.threads == {"warm-up": {loop}, "capture": {loop}, "replay": {loop}}
    assert loop is not threading.current_thread() and server.service.session.graphs.captures


def test_a_session_that_cannot_open_raises_from_service_and_leaves_no_engine_thread(small_path):
    before = _engine_threads()
    with pytest.raises(DeviceError, match=r"^device cuda:7: "):
        Service(serve_options(small_path, device="cuda:7"))
    with pytest.raises(ValueError, match=r"^slots must be at least 1, got -1$"):  # the session's, on the loop thread
        Service(serve_options(small_path, slots=-1))
    assert _engine_threads() == before
