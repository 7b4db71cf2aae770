"""`b12x serve` against `transformers serve`: the same tiny DeepSeek V4 weights, one server at a time.

The model is dsv4-tiny with fp32 weights (`init_weights` at a fixed seed) and the shipped
model's tokenizer (checkpoints/dsv41-mini: 2,048 tokens, so the vocabulary is widened to
it). transformers gets them as a checkpoint its `save_pretrained` wrote, b12x as a package
exported from the same tensors (its MTP draft is random: a drafter that accepts almost
nothing, as in a checkpoint without a trained one). Each server runs with its defaults and
one torch thread: `b12x serve PKG --threads 1` after `b12x compile PKG --threads 1` (what a
deployment runs once after export; untimed), and `transformers serve CHECKPOINT` with
OMP_NUM_THREADS=1.

A round starts one server, waits until /v1/models answers (its start time), serves the
request set (16 text prompts of 20 to 200 tokens, greedy, 64 new tokens) at concurrency 1,
4 and 16 through the official client, streaming, and stops it; then the other server, the
order flipping every round. From the client's side: output tokens/s of the whole set, time to
first token and time per output token (medians over requests). Every ratio is b12x over
transformers made so that above 1 b12x is better: tokens/s as they are, start time and the
latencies inverted (transformers' over b12x's).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from b12x_toolchain.exporter.hf.config_writer import hf_config_dict
from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from benchmarks.registry import Measurement, Settings, benchmark
from benchmarks.serving_http import concurrently, stop
from benchmarks.v4_reference import fp32_weights

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "checkpoints" / "dsv41-mini"
VOCAB = 2048  # the shipped tokenizer's
CONCURRENCY = (1, 4, 16)
NEW_TOKENS = 64
SEED = 0
MAX_ROUNDS = 3
START_TIMEOUT_S = 600


def prompts() -> list[str]:
    """16 prompts of 20 to about 185 tokens of the shipped tokenizer: the start of one Python text, cut longer each time."""
    from b12x_toolchain.runtime.serving.text import TextCodec

    codec = TextCodec.from_files((TOKENIZER / "tokenizer.json").read_bytes(),
                                 (TOKENIZER / "tokenizer_config.json").read_bytes())
    text = "".join(f"def step_{i}(state, action):\n    return update(state, action) + reward(state, {i})\n\n"
                   for i in range(40))
    ids = codec.encode(text)
    return [codec.decode(ids[:20 + 11 * i]) for i in range(16)]


def build(folder: Path) -> tuple[Path, Path]:
    """(checkpoint directory for transformers, b12x package) of the same weights and tokenizer."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from b12x_toolchain.exporter.hf.tokenizer_files import checkpoint_tokenizer

    recipe = recipe_variant(fp32_weights(load_recipe("dsv4-tiny")), {"model.vocab_size": VOCAB}, name="dsv4-peer")
    weights = init_weights(Dims.from_recipe(recipe), SEED)
    config = {k: v for k, v in hf_config_dict(recipe).items() if k not in ("model_type", "architectures")}
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**config)).eval()
    model.load_state_dict({k: v for k, v in weights.items() if not k.startswith("mtp.")}, strict=True)
    checkpoint = folder / "checkpoint"
    model.save_pretrained(checkpoint)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, checkpoint / name)
    package = export_package(recipe, folder / "package", weights=weights,
                             tokenizer=checkpoint_tokenizer(checkpoint, VOCAB)).path
    return checkpoint, package


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running(command: list[str], url: str, env: dict):
    """The server `command` until the block ends; yields its start time (launch to /v1/models answering)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not _answers(url):
            if process.poll() is not None or time.perf_counter() - start > START_TIMEOUT_S:
                raise RuntimeError(f"{command[:4]} did not start: {process.stderr.read()[-2000:]}")
            time.sleep(0.05)
        yield time.perf_counter() - start
    finally:
        stop(process)


class Client:
    """Streams text completions through the official client; times them as a user sees them."""

    def __init__(self, url: str, model: str):
        import openai

        self.api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        self.model = model

    def one(self, prompt: str) -> tuple[int, float, float]:
        """(output tokens, time to first token, time per output token after the first)."""
        sent = time.perf_counter()
        first = end = None
        tokens = 0
        for chunk in self.api.completions.create(model=self.model, prompt=prompt, max_tokens=NEW_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}):
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text and first is None:
                first = now
            if chunk.choices and chunk.choices[0].text:
                end = now
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        first = first or time.perf_counter()
        return tokens, first - sent, ((end or first) - first) / max(tokens - 1, 1)

    def serve(self, texts: list[str], concurrency: int) -> dict:
        results, wall = concurrently(texts, concurrency, self.one)
        return {"tokens_per_s": sum(r[0] for r in results) / wall,
                "ttft_s": statistics.median(r[1] for r in results), "tpot_s": statistics.median(r[2] for r in results)}


def one_round(name: str, command: list[str], url: str, model: str, env: dict) -> dict:
    with running(command, url, env) as started:
        client = Client(url, model)
        return {"start_s": started, **{count: client.serve(prompts(), count) for count in CONCURRENCY}}


def servers(checkpoint: Path, package: Path, port: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    b12x = [sys.executable, "-m", "b12x_toolchain.exporter.cli.main", "serve", str(package), "--port", str(port),
            "--threads", "1"]
    peer = [shutil.which("transformers") or str(Path(sys.executable).parent / "transformers"), "serve",
            str(checkpoint), "--host", "127.0.0.1", "--port", str(port + 1)]
    return {"b12x": (b12x, f"http://127.0.0.1:{port}", package.name.removesuffix(".b12x"), env),
            "transformers": (peer, f"http://127.0.0.1:{port + 1}", str(checkpoint), env)}


def measurements(rounds: dict[str, list[dict]], compile_s: float) -> list[Measurement]:
    def pair(pick) -> tuple[list[float], list[float]]:
        return [pick(r) for r in rounds["transformers"]], [pick(r) for r in rounds["b12x"]]

    out = []
    cases = [("start time", "s", lambda r: r["start_s"], True)]
    for count in CONCURRENCY:
        cases += [(f"concurrency {count} output", "tokens/s", lambda r, c=count: r[c]["tokens_per_s"], False),
                  (f"concurrency {count} time to first token", "ms", lambda r, c=count: r[c]["ttft_s"] * 1e3, True),
                  (f"concurrency {count} time per output token", "ms", lambda r, c=count: r[c]["tpot_s"] * 1e3, True)]
    for case, unit, pick, lower_is_better in cases:
        theirs, ours = pair(pick)
        base, cand = statistics.median(theirs), statistics.median(ours)
        ratio = base / cand if lower_is_better else cand / base
        out.append(Measurement("peer_serving", case, unit, "transformers serve", "b12x serve", base, cand, ratio,
                               {"new_tokens": NEW_TOKENS, "requests": len(prompts()), "compile_s": compile_s,
                                "ratio": "theirs / ours" if lower_is_better else "ours / theirs"}, theirs, ours))
    return out


def measure(settings: Settings, folder: Path, port: int = 8310) -> list[Measurement]:
    checkpoint, package = build(folder)
    start = time.perf_counter()  # what a deployment runs once after export: the compile cache filled
    subprocess.run([sys.executable, "-m", "b12x_toolchain.exporter.cli.main", "compile", str(package), "--threads", "1"],
                   check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)
    compile_s = time.perf_counter() - start
    commands = servers(checkpoint, package, port)
    rounds = {name: [] for name in commands}
    order = list(commands)
    for i in range(max(1, min(settings.repeat, MAX_ROUNDS))):
        for name in order if i % 2 == 0 else order[::-1]:
            rounds[name].append(one_round(name, *commands[name]))
    return measurements(rounds, compile_s)


@benchmark("peer_serving")
def peer_serving_benchmark(settings: Settings) -> list:
    with tempfile.TemporaryDirectory(prefix="b12x-peer-") as tmp:
        return measure(settings, Path(tmp))
