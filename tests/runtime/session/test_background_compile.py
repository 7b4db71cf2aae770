"""Compiled by default without waiting: an engine answers on its plain graphs while every bucket
compiles in the background, switches all of them at once between requests, and opens compiled
on a warm cache. Inductor is replaced here by a recording stand-in (test_compiled_replay
compiles for real): these tests are about which graph replays when, not about the kernels."""

from __future__ import annotations

import threading

import pytest
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.runtime import EngineOptions, load, open_engine
from b12x_toolchain.runtime.serving.http.metrics import ServerMetrics
from b12x_toolchain.runtime.serving.requests import Request
from b12x_toolchain.runtime.session import session as session_module
from b12x_toolchain.runtime.session.compiled import CACHE_ENV, CompiledGraph

OPTIONS = EngineOptions(slots=1, prefix_cache_bytes=0, compile=True)


class Recording:
    """A 'compiled' graph: the plain graph, counting its replays."""

    def __init__(self, graph):
        self.graph, self.replays = graph, 0

    def __call__(self, *args):
        self.replays += 1
        return self.graph(*args)


class FakeInductor:
    """Stands in for CompiledGraph.compile: records the thread it ran on, can be held or made to fail."""

    def __init__(self):
        self.release, self.threads, self.fail_pass = threading.Event(), [], None
        self.release.set()

    def compile(self, graph: CompiledGraph, args) -> None:
        self.threads.append(threading.current_thread())
        self.release.wait(60)
        if self.fail_pass is not None:
            raise RuntimeError(f"no compiler for {self.fail_pass}")
        graph._compiled = Recording(graph.graph)


@pytest.fixture
def inductor(monkeypatch, tmp_path):
    fake = FakeInductor()
    monkeypatch.setattr(CompiledGraph, "compile", lambda graph, args: fake.compile(graph, args))
    # Compiled on the worker thread itself, where the stand-in is (a child process would run Inductor).
    monkeypatch.setattr(session_module, "session_spec", lambda session: None)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "compiled"))
    return fake


def compiled_replays(engine) -> dict[str, int]:
    buckets = [(p, b) for p, by_rows in engine.session.buckets.items() for b in by_rows.values()]
    return {p: sum(b.graph._compiled.replays for q, b in buckets if q == p and isinstance(b.graph, CompiledGraph))
            for p, _ in buckets}


def request(n: int) -> Request:
    return Request([1, 2, 3, 4], max_new_tokens=n)


def test_requests_are_answered_before_compilation_and_every_graph_switches_between_requests(one_layer_path, inductor):
    inductor.release.clear()  # compilation cannot finish until released
    engine = open_engine(load(one_layer_path), OPTIONS)
    compiler = engine.session.compiler
    first = engine.generate([request(6)])[0]  # answered while nothing has compiled
    assert first.finish_reason == "length" and len(first.tokens) == 6
    assert compiler.status()["state"] == "compiling" and set(compiled_replays(engine).values()) == {0}

    long = engine.submit([request(12)])[0]
    engine.step()  # in flight
    inductor.release.set()
    assert compiler.wait(60) and compiler.status() == {"state": "ready", "buckets": len(compiler.buckets),
                                                      "compiled": len(compiler.buckets), "error": None}
    engine.run()  # the request in flight finishes on the graphs it started on
    assert long.finish_reason == "length" and set(compiled_replays(engine).values()) == {0}

    again = engine.generate([request(6)])[0]  # the next request starts on compiled graphs, every pass at once
    assert compiler.status()["state"] == "compiled" and again.tokens == first.tokens
    replays = compiled_replays(engine)
    assert set(replays) == set(engine.passes) and replays["prefill"] > 0 and replays["decode"] + replays["verify"] > 0
    assert all(isinstance(b.graph, CompiledGraph) for by_rows in engine.session.buckets.values()
               for b in by_rows.values())
    assert threading.main_thread() not in inductor.threads  # compiled off the serving thread

    # On the cache that compilation filled, the next engine opens compiled: its first request replays compiled.
    inductor.threads.clear()
    warm = open_engine(load(one_layer_path), OPTIONS)
    assert warm.session.compiler.status()["state"] == "compiled"
    assert set(inductor.threads) == {threading.current_thread()}  # loaded while the engine opened
    warm.generate([request(2)])
    assert compiled_replays(warm)["prefill"] == 1


def test_a_failed_compilation_keeps_the_plain_graphs_and_says_so(one_layer_path, inductor):
    inductor.fail_pass = "prefill"
    engine = open_engine(load(one_layer_path), OPTIONS)
    assert engine.session.compiler.wait(60)
    assert engine.generate([request(3)])[0].finish_reason == "length"
    status = engine.session.compiler.status()
    assert status["state"] == "failed" and "no compiler for prefill" in status["error"]
    assert not any(isinstance(b.graph, CompiledGraph) for by_rows in engine.session.buckets.values()
                   for b in by_rows.values())
    metrics = ServerMetrics()
    metrics.record_compile(engine.session.compiler)
    text = metrics.render()[0].decode()
    assert "b12x_compile_failed 1.0" in text and "b12x_compiled_replay 0.0" in text


def test_a_compiling_process_that_cannot_start_ends_the_compilation_as_failed(one_layer_path, monkeypatch, tmp_path):
    from b12x_toolchain.runtime.session import compile_worker

    def no_child(spec):
        raise OSError("no such interpreter")

    monkeypatch.setattr(compile_worker, "run_child", no_child)
    session = load(one_layer_path).session(slots=1, compile=("verify",), compile_in_background=True,
                                           compile_cache=tmp_path)
    assert session.compiler.wait(10)  # ended, not left compiling forever
    status = session.compiler.status()
    assert status["state"] == "failed"
    assert status["error"] == "the compiling process could not start: no such interpreter"
    assert not session.swap_in_compiled()


def test_compile_command_fills_the_cache_a_server_with_the_same_flags_opens_compiled(one_layer_path, inductor):
    result = CliRunner().invoke(main, ["compile", str(one_layer_path), "--slots", "1"])
    assert result.exit_code == 0, result.output
    engine = open_engine(load(one_layer_path), OPTIONS)
    assert f"{len(engine.session.compiler.buckets)} pass graphs compiled" in result.output
    assert engine.session.compiler.status()["state"] == "compiled"
    metrics = ServerMetrics()
    metrics.record_compile(engine.session.compiler)
    assert "b12x_compiled_replay 1.0" in metrics.render()[0].decode()
    # Other shapes (two slots) are another set: compiled in the background again.
    other = open_engine(load(one_layer_path), EngineOptions(slots=2, prefix_cache_bytes=0, compile=True))
    assert other.session.compiler.wait(60) and other.session.compiler.status()["state"] == "ready"


def test_compilation_is_on_by_default_and_one_switch_turns_it_off(one_layer_path, inductor, monkeypatch):
    monkeypatch.delenv("B12X_COMPILE")
    assert EngineOptions().compile
    engine = open_engine(load(one_layer_path), EngineOptions(slots=1, prefix_cache_bytes=0))
    assert engine.configuration()["compiled_passes"] == list(engine.passes)
    off = open_engine(load(one_layer_path), EngineOptions(slots=1, prefix_cache_bytes=0, compile=False))
    assert off.session.compiler is None and off.configuration()["compiled_passes"] == []
    engine.session.compiler.wait(60)
    result = CliRunner().invoke(main, ["run", str(one_layer_path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                                       "--slots", "1"])
    assert result.exit_code == 0 and "replay: compiled (" in result.output, result.output  # the cache is warm now
    inductor.threads.clear()
    result = CliRunner().invoke(main, ["run", str(one_layer_path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2",
                                       "--slots", "1", "--no-compile"])
    assert result.exit_code == 0 and inductor.threads == [] and "replay:" not in result.output, result.output
    monkeypatch.setenv("B12X_COMPILE", "0")
    assert not EngineOptions().compile
