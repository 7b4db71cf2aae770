"""`b12x serve --nproc 2` against one device: what serving a parallel package across ranks costs.

The same tiny model exported for one device and for tensor 2 over two ranks (the same
weights), each served by `b12x serve` in processes of its own (the world-2 server is a
launcher, torchrun and two ranks in lockstep), in alternating rounds, the same request set
as `serving_http` (greedy, streamed by N client threads) at concurrency 1 and 8.

ratio = world 2 over world 1 output tokens/s. On one machine's CPU cores the ranks share
the cores the single device had, so the ratio says little about a real deployment; the
figure this benchmark is for is the control messages' cost: rank 0's time sending each
step's operations to the other rank and hearing back (`b12x_control_seconds`), per engine
step in microseconds and as a share of the step (`b12x_step_seconds`), read from the
world-2 server's /metrics before and after the rounds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.runtime import load
from benchmarks.registry import Settings, benchmark, compare_rates
from benchmarks.serving_http import Clients, request_set, serve

RECIPE = "dsv41-tiny"
CONCURRENCY = (1, 8)
MAX_ROUNDS = 3


def control_counters(url: str) -> dict[str, float]:
    """rank 0's control seconds and messages, and the engine's steps and their seconds, from /metrics."""
    wanted = {"b12x_control_seconds": "control_seconds", "b12x_control_messages": "control_messages",
              "b12x_step_seconds_count": "steps", "b12x_step_seconds_sum": "step_seconds"}
    text = httpx.get(url + "/metrics", timeout=30).text
    return {wanted[sample.name]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name in wanted}


def control_cost(before: dict, after: dict) -> dict[str, float]:
    """Between two readings: the control messages' microseconds per step and share of the step time."""
    steps = after["steps"] - before["steps"]
    control = after["control_seconds"] - before["control_seconds"]
    step_seconds = after["step_seconds"] - before["step_seconds"]
    return {"steps": steps, "control_messages": after["control_messages"] - before["control_messages"],
            "control_us_per_step": control / steps * 1e6 if steps else 0.0,
            "control_share_of_step": control / step_seconds if step_seconds else 0.0}


def measure(one_path: Path, parallel_path: Path, settings: Settings, concurrency=CONCURRENCY) -> list:
    prompts = request_set(load(one_path).vocab_size)
    rounds = Settings(repeat=min(settings.repeat, MAX_ROUNDS), warmup=min(settings.warmup, 1))
    model = "bench"
    out = []
    with serve(one_path, "--model-name", model, slots=max(concurrency)) as one_url, \
            serve(parallel_path, "--model-name", model, "--nproc", 2, slots=max(concurrency)) as two_url:
        for count in concurrency:
            one, two = Clients(one_url, model), Clients(two_url, model)
            before = control_counters(two_url)
            result = compare_rates("serving_ranks", f"concurrency {count}", lambda: one.serve(prompts, count),
                                   lambda: two.serve(prompts, count), rounds, "world 1", "world 2 (tensor 2)",
                                   "tokens/s")
            result.params = {"concurrency": count, **control_cost(before, control_counters(two_url))}
            out.append(result)
    return out


@benchmark("serving_ranks")
def serving_ranks_benchmark(settings: Settings) -> list:
    recipe = load_recipe(RECIPE)
    parallel = recipe_variant(recipe, {"parallel": {"tensor": 2}}, name=f"{RECIPE}-tensor2")
    with tempfile.TemporaryDirectory(prefix="b12x-bench-") as tmp:
        one = export_package(recipe, Path(tmp) / "one").path
        return measure(one, export_package(parallel, Path(tmp) / "two").path, settings)
