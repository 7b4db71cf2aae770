"""One builder for every front end: `b12x run`, `b12x serve` and the loader API build their engine
from the same EngineOptions, with the same defaults, so the same flags give the same engine."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import b12x_toolchain.runtime.serving.http.server as server_module
from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.runtime import EngineOptions, load, open_engine, open_prefix_cache
from b12x_toolchain.runtime.serving.engine import Engine

FLAGS = ["--slots", "2", "--temperature", "0.7", "--top-p", "0.9", "--seed", "5", "--pages", "40", "--always-draft"]
SAME = EngineOptions(slots=2, temperature=0.7, top_p=0.9, seed=5, pages=40, adaptive=False)


class NoListening:
    """Stands in for the HTTP server: `b12x serve` builds its service, then it closes at once."""

    def __init__(self, service, *args):
        self.service, self.url = service, "http://127.0.0.1:0"

    def run(self):
        self.service.close()


@pytest.fixture
def built(monkeypatch) -> list[Engine]:
    engines, real = [], Engine.__init__

    def recording(self, *args, **kwargs):
        real(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(Engine, "__init__", recording)
    monkeypatch.setattr(server_module, "Server", NoListening)
    return engines


def front_ends(path, flags: list[str], options: EngineOptions, engines: list[Engine]) -> list[dict]:
    """The configuration of the engine each front end builds: run, serve, then the loader API."""
    result = CliRunner().invoke(main, ["run", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", *flags])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["serve", str(path), *flags])
    assert result.exit_code == 0, result.output
    package = load(path)
    cache = open_prefix_cache(package, options)
    try:
        open_engine(package, options, cache)
    finally:
        cache is None or cache.close()
    assert len(engines) == 3
    return [engine.configuration() for engine in engines]


def test_run_serve_and_the_loader_api_build_the_same_engine(small_path, built):
    run, serve, loader = front_ends(small_path, FLAGS, SAME, built)
    assert run == serve == loader
    assert run["slots"] == 2 and run["temperature"] == 0.7 and run["top_p"] == 0.9 and run["seed"] == 5
    assert set(run["pages"].values()) == {40} and run["speculative"] and not run["adaptive"]


def test_the_defaults_are_one_set_with_the_prefix_cache_on(small_path, built):
    run, serve, loader = front_ends(small_path, [], EngineOptions(), built)
    assert run == serve == loader
    assert run["prefix_cache"] == {"enabled": True, "l1_bytes": 1 << 30, "l2_dir": None, "l2_bytes": 0}
    assert run["slots"] == load(small_path).passes["verify"].rows_buckets[-1]
    assert run["speculative"] and run["adaptive"]  # drafting steps aside while it does not pay


def test_options_that_cannot_work_are_refused_by_name():
    with pytest.raises(ValueError, match=r"pages \(4\) and cache_bytes \(4096\)"):
        EngineOptions(pages=4, cache_bytes=4096)
    with pytest.raises(ValueError, match=r"speculative=False decodes greedily; it cannot be combined with temperature above 0 \(got 0.5\)"):
        EngineOptions(speculative=False, temperature=0.5)
    with pytest.raises(ValueError, match="prefix_cache_bytes above 0"):
        EngineOptions(prefix_cache_bytes=0, prefix_cache_dir="snapshots")
    result = CliRunner().invoke(main, ["serve", "--help"])
    flags_of = lambda name: {o for p in main.commands[name].params for o in p.opts}  # noqa: E731
    engine_flags = {"--device", "--slots", "--pages", "--cache-bytes", "--greedy", "--temperature", "--top-p",
                    "--seed", "--prefix-cache-bytes", "--prefix-cache-dir", "--compile", "--threads", "--always-draft"}
    assert result.exit_code == 0 and engine_flags <= flags_of("run") and engine_flags <= flags_of("serve")
