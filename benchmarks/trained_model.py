"""The shipped trained model (checkpoints/dsv41-mini): what speculative decoding buys on it.

Exported from its release-layout checkpoint, decoded on held-out prompts (the standard
library files its training never saw) at temperature 0, one thread, uncompiled replay:

* tokens per step: mean tokens each speculative step commits (accepted drafts + the bonus
  token), over every request's decode steps;
* speculative vs plain: decode tokens/s of the engine speculating with the package's draft
  pass, against the same package decoding one token a step through its decode pass (no
  drafter). Prefill is the same on both sides and left out. Each request runs alone;
* held-out perplexity of the target: exp(mean next-token loss) over fixed held-out windows,
  from the package's own prefill replays (the shipped formats, quantized caches included);
* what exact decoding costs: decode tokens/s of the op set's row-invariant arithmetic
  against the arithmetic torch picks by shape (`fixed_order.shape_dependent`, what the ops
  did before), plain and speculative, on the first EXACT_PROMPTS prompts. The two round
  differently, so their greedy texts (and so tokens per step) may part; both are reported.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from b12x_toolchain.exporter.hf.tokenizer_files import checkpoint_export_inputs
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.train.corpus import load_corpus
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.ops import fixed_order
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from benchmarks.registry import Measurement, Settings, benchmark, compare_rates

CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "dsv41-mini"
RECIPE = "dsv41-mini"
PROMPTS = 16  # held-out files, one prompt each
PROMPT_TOKENS = 64
NEW_TOKENS = 64
PROMPT_OFFSET = 128  # into each file: past the license header and module docstring
EXACT_PROMPTS = 4
PERPLEXITY_WINDOWS = 32
WINDOW = 128


def heldout_token_files(tokenizer: Tokenizer) -> list[list[int]]:
    return [enc.ids for enc in tokenizer.encode_batch(list(load_corpus().heldout))]


def heldout_prompts(files: list[list[int]]) -> list[list[int]]:
    """The first PROMPTS held-out files long enough, PROMPT_TOKENS tokens from PROMPT_OFFSET each."""
    long_enough = [ids for ids in files if len(ids) >= PROMPT_OFFSET + PROMPT_TOKENS + NEW_TOKENS]
    return [ids[PROMPT_OFFSET : PROMPT_OFFSET + PROMPT_TOKENS] for ids in long_enough[:PROMPTS]]


def export_shipped(out: Path):
    """The checkpoint exported as `b12x export --recipe dsv41-mini --checkpoint ...` does."""
    recipe = load_recipe(RECIPE)
    weights, source, tokenizer = checkpoint_export_inputs(CHECKPOINT, recipe)
    return load(export_package(recipe, out, weights=weights, weights_source=source, tokenizer=tokenizer).path)


def perplexity(session, files: list[list[int]]) -> float:
    """Over PERPLEXITY_WINDOWS windows of WINDOW tokens, one from each held-out file in turn."""
    chunk = session.package.passes["prefill"].width
    windows = [ids[:WINDOW] for ids in files if len(ids) >= WINDOW][:PERPLEXITY_WINDOWS]
    total, count = 0.0, 0
    for window in windows:
        session.reset_slot(0)  # every window from position 0
        logits = []
        for start in range(0, WINDOW, chunk):
            out = session.replay("prefill", token_ids=[window[start : start + chunk]], slot_ids=[0],
                                 positions=[start], new_tokens=[chunk])
            logits.append(out["logits"][0].clone())  # the output buffer is reused by the next replay
        logits = torch.cat(logits)
        total += float(F.cross_entropy(logits[:-1], torch.tensor(window[1:]), reduction="sum"))
        count += WINDOW - 1
    return math.exp(total / count)


def decode(session, prompts, speculative: bool) -> dict:
    """Every prompt alone; decode tokens/s and tokens per step over all of them."""
    generated = steps = 0
    seconds = 0.0
    for prompt in prompts:
        engine = Engine(session, speculative=speculative)
        engine.generate([Request(prompt, NEW_TOKENS)])
        stats = engine.stats.as_dict()
        generated += stats["generated"] - 1  # the first token comes from prefill
        steps += stats["steps"]
        seconds += stats["decode_seconds"]
    return {"tokens_per_second": generated / seconds, "tokens_per_step": generated / steps, "steps": steps}


def measure(package, settings: Settings) -> list[Measurement]:
    tokenizer = Tokenizer.from_file(str(CHECKPOINT / "tokenizer.json"))
    files = heldout_token_files(tokenizer)
    prompts = heldout_prompts(files)
    session = package.session(device="cpu", slots=1)
    last = {}

    def rate(label: str, speculative: bool):
        def run() -> float:
            last[label] = decode(session, prompts, speculative)
            return last[label]["tokens_per_second"]
        return run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = compare_rates("trained_model.speculative_vs_plain", f"{len(prompts)} held-out prompts, greedy",
                              rate("plain", False), rate("speculative", True), settings, "decode pass",
                              "speculative", "tokens/s")
        ppl = perplexity(session, files)
    finally:
        torch.set_num_threads(threads)
    rates.params = {"prompts": len(prompts), "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
                    "tokens_per_step": last["speculative"]["tokens_per_step"],
                    "speculative_steps": last["speculative"]["steps"], "plain_steps": last["plain"]["steps"],
                    "heldout_perplexity": ppl}
    per_step = Measurement("trained_model.tokens_per_step", "speculative, per decode step", "tokens", "plain",
                           "speculative", 1.0, last["speculative"]["tokens_per_step"],
                           last["speculative"]["tokens_per_step"], dict(rates.params))
    return [rates, per_step] + exact_cost(session, prompts[:EXACT_PROMPTS], settings)


def exact_cost(session, prompts, settings: Settings) -> list[Measurement]:
    """Row-invariant ops against shape-dependent ones, plain and speculative (one thread)."""
    out = []
    for label, speculative in (("decode pass", False), ("speculative", True)):
        steps = {}

        def rate(exact: bool, speculative=speculative, steps=steps):
            def run() -> float:
                if exact:
                    result = decode(session, prompts, speculative)
                else:
                    with fixed_order.shape_dependent():
                        result = decode(session, prompts, speculative)
                steps[exact] = result["tokens_per_step"]
                return result["tokens_per_second"]
            return run

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            m = compare_rates("trained_model.exact_cost", f"{label}, {len(prompts)} held-out prompts", rate(False),
                              rate(True), settings, "shape-dependent ops", "row-invariant ops", "tokens/s")
        finally:
            torch.set_num_threads(threads)
        m.params = {"prompts": len(prompts), "tokens_per_step_shape_dependent": steps[False],
                    "tokens_per_step_row_invariant": steps[True]}
        out.append(m)
    return out


@benchmark("trained_model")
def trained_model_benchmark(settings: Settings) -> list[Measurement]:
    with tempfile.TemporaryDirectory(prefix="b12x-bench-") as tmp:
        package = export_shipped(Path(tmp))
    return measure(package, Settings(repeat=min(settings.repeat, 3), warmup=min(settings.warmup, 1)))
