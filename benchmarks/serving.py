"""Serving-loop throughput of the tiny recipe on CPU.

Two comparisons, both in tokens/s (a rate, so a ratio above 1 means the candidate is faster):

* speculative vs plain: one request. The baseline decodes one token per step (verify with
  no drafts); the candidate speculates with drafts taken from the target's own greedy
  continuation, so every draft is accepted — the best any drafter can do — and each step
  emits verify-width tokens. Decode tokens/s: prefill is the same on both sides and left out.
* concurrency: 1, 2, 4 and 8 requests served together by the engine as `b12x run` runs it
  (drafts from the package's draft pass), against one request alone. Tokens/s end to end,
  prefill included, so the ratio is what batching requests into rows buckets buys.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from benchmarks.registry import Settings, benchmark, compare_rates

RECIPE = "dsv41-tiny"
PROMPT_TOKENS = 32
NEW_TOKENS = 33  # the first from prefill, then 32 decoded: four full speculative steps of 8
CONCURRENCY = (1, 2, 4, 8)
CONCURRENT_NEW_TOKENS = 16
SEED = 0


def prompts(package, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, package.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(count)]


def oracle_drafter(truth: list[int], width: int, noise: int):
    """Drafts the target's own greedy continuation: each row's next `width` tokens of `truth`."""

    def drafter(rows):
        return [(truth[len(r.tokens) : len(r.tokens) + width] + [noise] * width)[:width] for r in rows]

    return drafter


def speculative_vs_plain(session, settings: Settings):
    package = session.package
    prompt = prompts(package, 1)[0]
    truth = Engine(session, speculative=False).generate([Request(prompt, NEW_TOKENS)])[0].tokens
    drafter = oracle_drafter(truth, package.passes["draft"].width, package.manifest.model.noise_token_id)
    last = {}

    def decode_rate(label: str, **options):
        def run() -> float:
            engine = Engine(session, **options)
            engine.generate([Request(prompt, NEW_TOKENS)])
            last[label] = engine.stats.as_dict()
            return last[label]["decode_tokens_per_second"]

        return run

    result = compare_rates("serving.speculative_vs_plain", "1 request, drafts = greedy continuation",
                           decode_rate("plain", speculative=False), decode_rate("speculative", drafter=drafter),
                           settings, "plain", "speculative", "tokens/s")
    result.params = {"new_tokens": NEW_TOKENS, "prompt_tokens": PROMPT_TOKENS,
                     **{f"{side}_{key}": last[side][key] for side in last
                        for key in ("steps", "tokens_per_step", "acceptance_rate")}}
    return result


def concurrency(session, settings: Settings) -> list:
    every = prompts(session.package, max(CONCURRENCY))
    out = []
    for count in CONCURRENCY:
        last = {}

        def throughput(n: int):
            def run() -> float:
                engine = Engine(session)
                start = time.perf_counter()
                engine.generate([Request(p, CONCURRENT_NEW_TOKENS) for p in every[:n]])
                last[n] = engine.stats.as_dict()
                return engine.stats.generated / (time.perf_counter() - start)

            return run

        result = compare_rates("serving.concurrency", f"{count} concurrent", throughput(1), throughput(count),
                               settings, "1 request", f"{count} requests", "tokens/s")
        result.params = {"requests": count, "new_tokens": CONCURRENT_NEW_TOKENS, "prompt_tokens": PROMPT_TOKENS,
                         "steps": last[count]["steps"], "padding_rows": last[count]["padding_rows"],
                         "acceptance_rate": last[count]["acceptance_rate"]}
        out.append(result)
    return out


def measure(package, settings: Settings) -> list:
    session = package.session(device="cpu", slots=max(CONCURRENCY))
    return [speculative_vs_plain(session, settings)] + concurrency(session, settings)


@benchmark("serving")
def serving_benchmark(settings: Settings) -> list:
    with tempfile.TemporaryDirectory(prefix="b12x-bench-") as tmp:
        package = load(export_package(load_recipe(RECIPE), Path(tmp)).path)
    # load() reads every file into memory, so the package outlives its directory.
    return measure(package, settings)
