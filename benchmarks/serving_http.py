"""`b12x serve` against the engine it wraps: what the HTTP layer costs, on loopback.

A fixed set of requests (random prompt tokens, greedy, a fixed number of new tokens) is
served at concurrency 1, 4 and 16, twice per round:

* baseline: the engine offline, `Engine.generate` over the same requests with at most N
  of them in slots at once (`slots=range(N)`), no HTTP;
* candidate: a `b12x serve` process (on a loopback port, as many torch threads as this
  process, no prefix cache, so repeated rounds prefill again) and N client threads in
  this process, each streaming one request after another through the official `openai`
  client. The server has a process of its own, as deployed: in this one, the clients'
  threads would contend with the engine for the interpreter.

ratio = server tokens/s over offline tokens/s (output tokens over the wall time of the
whole set); the target is 0.9 or more. Each server row also records, from the client's
side, time to first token (p50, p99), inter-token latency (p50) and output tokens/s.
"""

from __future__ import annotations

import contextlib
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.engine import Engine, passes_used
from b12x_toolchain.runtime.serving.requests import Request
from benchmarks.registry import Settings, benchmark, compare_rates

RECIPE = "dsv41-tiny"
REQUESTS = 16
PROMPT_TOKENS = 32
NEW_TOKENS = 24
CONCURRENCY = (1, 4, 16)
MAX_ROUNDS = 3  # a round serves the whole set twice; bounded whatever --repeat asks
SEED = 0


def request_set(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, vocab_size, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(REQUESTS)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


class Clients:
    """N threads streaming the request set through the official client; latencies as the client sees them."""

    def __init__(self, url: str, model: str):
        import openai

        self.api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.model = model
        self.ttft: list[float] = []
        self.itl: list[float] = []

    def one(self, prompt: list[int]) -> int:
        sent = last = time.perf_counter()
        tokens = 0
        for chunk in self.api.completions.create(model=self.model, prompt=prompt, max_tokens=NEW_TOKENS, stream=True):
            ids = chunk.choices[0].token_ids if chunk.choices else []
            if not ids:
                continue
            now = time.perf_counter()
            if tokens == 0:
                self.ttft.append(now - sent)
            else:
                self.itl += [(now - last) / len(ids)] * len(ids)
            tokens, last = tokens + len(ids), now
        return tokens

    def serve(self, prompts: list[list[int]], concurrency: int) -> float:
        """Output tokens/s of the whole set, `concurrency` requests in flight."""
        counts, wall = concurrently(prompts, concurrency, self.one)
        return sum(counts) / wall


def concurrently(items: list, concurrency: int, one) -> tuple[list, float]:
    """`one(item)` for every item from `concurrency` threads, each taking the next item when done;
    (the results, in the order they finished; the wall time of the whole set)."""
    todo, lock, results = list(items), threading.Lock(), []

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                item = todo.pop(0)
            results.append(one(item))

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start


@contextlib.contextmanager
def serve(package_path: Path, *args, slots: int = max(CONCURRENCY)):
    """A `b12x serve` process on a free loopback port (`args` added to its command line); yields
    its URL. SIGTERM at the end."""
    command = [sys.executable, "-m", "b12x_toolchain.exporter.cli.main", "serve", str(package_path), "--port", "0",
               "--slots", str(slots), "--threads", str(torch.get_num_threads()), *map(str, args)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        found = re.search(r"at (http://\S+)/v1", line)
        if found is None:
            raise RuntimeError(f"b12x serve did not start: {line}{process.stderr.read()}")
        yield found.group(1)
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    """SIGTERM a server and wait for it to drain (a minute at most, then kill)."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
    process.stderr.close()


def measure(package_path: Path, settings: Settings) -> list:
    package = load(package_path)
    session = package.session(device="cpu", slots=max(CONCURRENCY), passes=passes_used(package.passes))
    prompts = request_set(package.vocab_size)
    rounds = Settings(repeat=min(settings.repeat, MAX_ROUNDS), warmup=min(settings.warmup, 1))
    out = []
    with serve(package_path) as url:
        for count in CONCURRENCY:
            clients = Clients(url, Path(package_path).name.removesuffix(".b12x"))

            def offline() -> float:
                engine = Engine(session, slots=range(count))
                start = time.perf_counter()
                engine.generate([Request(p, NEW_TOKENS) for p in prompts])
                return engine.stats.generated / (time.perf_counter() - start)

            result = compare_rates("serving_http", f"concurrency {count}", offline,
                                   lambda: clients.serve(prompts, count), rounds, "engine offline",
                                   "b12x serve", "tokens/s")
            result.params = {"requests": REQUESTS, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
                             "concurrency": count, "ttft_p50_ms": percentile(clients.ttft, 0.5) * 1e3,
                             "ttft_p99_ms": percentile(clients.ttft, 0.99) * 1e3,
                             "itl_p50_ms": percentile(clients.itl, 0.5) * 1e3,
                             "itl_mean_ms": statistics.fmean(clients.itl) * 1e3 if clients.itl else 0.0,
                             "server_tokens_per_s": result.candidate, "offline_tokens_per_s": result.baseline}
            out.append(result)
    return out


@benchmark("serving_http")
def serving_http_benchmark(settings: Settings) -> list:
    with tempfile.TemporaryDirectory(prefix="b12x-bench-") as tmp:
        return measure(export_package(load_recipe(RECIPE), Path(tmp)).path, settings)
