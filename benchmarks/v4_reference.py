"""DeepSeek V4 on CPU: b12x's runtime against `transformers`' DeepseekV4ForCausalLM.

Both sides run the tiny V4 recipe with the very same weights (`init_weights` with a fixed
seed, exported into the package; the reference loads the package's tensors by name) in
one process, and every comparison is a rate in tokens/s with ratio = b12x / transformers,
so above 1 b12x is faster.

* decode, greedy: prefill the prompt, then decode one token per step. b12x runs the
  Decoder's non-speculative loop: one replay of the decode pass per token (one token,
  written straight into the caches); transformers calls the model on one token at a time
  with its own cache (`DynamicCache(config=...)`, which holds V4's compressor and indexer
  state) and takes the argmax. Decode tokens/s: the prefill before it is the same work every
  round and left out.
* decode, speculative: the same request, b12x speculating with drafts taken from its own
  greedy continuation (every draft accepted: 8 tokens per verify + commit step), against
  the same one-token-at-a-time transformers loop.
* prefill: the whole prompt, chunk by chunk through b12x's prefill pass (writing the
  caches), against one transformers forward over it with a fresh cache. Both produce
  logits for every prompt position.

Every case runs with the uncompiled replay and again with the compiled one (`compile=` on the
session: Inductor, compiled in the untimed first streams; session/compiled.py).

Before timing, the greedy token streams are compared: b12x's plain stream against the
reference's, and the speculative stream against the plain one. A difference is recorded
in `params` and warned about, never raised: near ties can flip, and the recipe's
quantised cache formats (ocp_mxfp8 window and compressed rows) move logits by more than the
gap between the top two tokens now and then. Every case therefore runs twice: on the
recipe as written and on the same recipe with fp32 caches, whose logits match the
reference to float rounding. So four rows per case: recipe and fp32 caches, each uncompiled
and compiled.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import torch

from b12x_toolchain.exporter.hf.config_writer import hf_config_dict
from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_from_dict, recipe_variant
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.speculative import Decoder
from benchmarks.registry import Settings, benchmark, compare_rates
from benchmarks.serving import oracle_drafter

RECIPE = "dsv4-tiny"
PROMPT_TOKENS = 256  # two 128-token prefill chunks: far past the 32-token window, many HCA groups closed
NEW_TOKENS = 33  # the first from prefill, then 32 decoded: four full speculative steps of 8
SEED = 0
FP32_CACHES = {"window_format": "fp32", "compressed_format": "fp32", "index_format": "fp32"}
COMPILED_PASSES = ("prefill", "decode", "verify", "commit")  # what these cases replay (the oracle drafts)


def fp32_weights(recipe):
    """The recipe with every weight in fp32: the bundled dsv4-tiny stores the release's FP8/FP4
    formats, and the reference here is transformers over the same fp32 weights (the quantized
    package is measured against its fp32 twin by `quantized_decode`)."""
    data = recipe.normalized()
    data.pop("weights", None)
    return recipe_from_dict(data)


def fp32_variant(recipe):
    """The recipe with every quantised cache stored as fp32 (nothing else changes)."""
    return recipe_variant(recipe, {f"cache.{key}": value for key, value in FP32_CACHES.items()},
                          name=f"{recipe.name}-fp32")


def package_recipe(package):
    return recipe_from_dict(package.manifest.recipe)


def reference_model(package):
    """transformers' DeepseekV4ForCausalLM on the package's recipe, with the package's weights.

    b12x stores V4 tensors under the checkpoint's names, so they load as they are; the MTP
    stage's tensors are the draft's and the reference has no use for them.
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = {k: v for k, v in hf_config_dict(package_recipe(package)).items()
              if k not in ("model_type", "architectures")}
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**config)).eval()
    model.load_state_dict({k: v for k, v in package.weights.items() if not k.startswith("mtp.")}, strict=True)
    return model


def margin(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


class Reference:
    """Greedy decoding with transformers' own cache, one token per forward."""

    def __init__(self, model, prompt: list[int]):
        from transformers import DynamicCache

        self.model, self.cache_type = model, DynamicCache
        self.prompt = torch.tensor([prompt])
        self.margins: list[float] = []

    def prefill(self):
        cache = self.cache_type(config=self.model.config)
        with torch.no_grad():
            logits = self.model(input_ids=self.prompt, cache=cache, use_cache=True).logits
        return cache, logits[0, -1]

    def decode(self, new_tokens: int) -> tuple[list[int], float]:
        """The greedy stream (first token from prefill) and the seconds spent after prefill."""
        cache, last = self.prefill()
        tokens, self.margins = [int(last.argmax())], [margin(last)]
        start = time.perf_counter()
        with torch.no_grad():
            while len(tokens) < new_tokens:
                logits = self.model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits
                tokens.append(int(logits[0, -1].argmax()))
                self.margins.append(margin(logits[0, -1]))
        return tokens, time.perf_counter() - start


def b12x_decode(session, prompt: list[int], new_tokens: int, drafter=None) -> tuple[list[int], float, Decoder]:
    """Decoder steps on slot 0 until `new_tokens` tokens exist; speculative when given a drafter.

    Returns every token produced (a speculative step may overshoot), the seconds spent
    stepping (prefill excluded) and the decoder, for its stats and margins.
    """
    decoder = Decoder(session, drafter=drafter)
    row = decoder.prefill(0, prompt)
    start = time.perf_counter()
    while len(row.tokens) < new_tokens:
        decoder.step([row], speculative=drafter is not None)
    return row.tokens, time.perf_counter() - start, decoder


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(label: str, what: str, ours: list[int], theirs: list[int], our_margins: list[float],
              their_margins: list[float]) -> dict:
    """Compare two greedy streams; warn (never raise) where they part, with the top-2 gaps there."""
    i = first_difference(ours, theirs)
    if i is None:
        return {"tokens_agree": True, "first_difference": None}
    gaps = {"b12x_margin": our_margins[i] if i < len(our_margins) else None,
            "reference_margin": their_margins[i] if i < len(their_margins) else None}
    warnings.warn(f"v4_reference ({label}): {what} greedy tokens differ from new token {i} of {len(theirs)} "
                  f"({ours[i:i + 4]}... vs {theirs[i:i + 4]}...; top-2 logit gaps there {gaps}). Near ties can "
                  "flip, and quantised cache formats move logits; only the fp32 case is expected to agree",
                  RuntimeWarning, stacklevel=2)
    return {"tokens_agree": False, "first_difference": i, **gaps}


def measure(package, settings: Settings, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS,
            label: str | None = None, compiled: bool = False) -> list:
    """Every case on one package: decode greedy, decode speculative, prefill; ratio = b12x / transformers.

    `compiled`: b12x replays the passes these cases run through Inductor (session/compiled.py);
    they compile during the untimed first streams, so no timed round includes a compilation.
    """
    recipe = package_recipe(package)
    label = label or recipe.name
    width = package.passes["verify"].width
    if prompt_tokens + new_tokens + width > package.manifest.model.max_seq_len:
        raise ValueError(f"{prompt_tokens} prompt + {new_tokens} new tokens do not fit max_seq_len")
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, package.vocab_size, (prompt_tokens,), generator=gen).tolist()
    replayed = tuple(p for p in COMPILED_PASSES if p in package.passes)
    session = package.session(device="cpu", slots=1, compile=replayed if compiled else False)
    reference = Reference(reference_model(package), prompt)
    formats = {k: getattr(recipe.cache, k) for k in FP32_CACHES}
    common = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "cache_formats": formats,
              "compiled_replay": compiled}

    # The streams, once, untimed: what each side decodes, and the oracle's truth.
    theirs, _ = reference.decode(new_tokens)
    plain, _, plain_decoder = b12x_decode(session, prompt, new_tokens)
    drafter = oracle_drafter(plain, package.passes["draft"].width, package.manifest.model.noise_token_id)
    spec, _, spec_decoder = b12x_decode(session, prompt, new_tokens, drafter)
    plain_check = agreement(label, "b12x and transformers", plain[:new_tokens], theirs,
                            plain_decoder.margins[0], reference.margins)
    spec_check = agreement(label, "b12x speculative and b12x plain", spec[:new_tokens], plain[:new_tokens],
                           spec_decoder.margins[0], plain_decoder.margins[0])

    last = {}

    def theirs_rate() -> float:
        tokens, seconds = reference.decode(new_tokens)
        return (len(tokens) - 1) / seconds

    def ours_rate(side: str, drafter=None):
        def run() -> float:
            tokens, seconds, decoder = b12x_decode(session, prompt, new_tokens, drafter)
            last[side] = decoder.stats.as_dict()
            return (len(tokens) - 1) / seconds  # the first token came from prefill

        return run

    plain_case = compare_rates("v4_reference.decode", f"greedy, 1 token/step ({label})", theirs_rate,
                               ours_rate("plain"), settings, "transformers", "b12x", "tokens/s")
    plain_case.params = {**common, "mode": "greedy", **plain_check, "b12x_steps": last["plain"]["steps"]}
    spec_case = compare_rates("v4_reference.decode", f"speculative, oracle drafts ({label})", theirs_rate,
                              ours_rate("speculative", drafter), settings, "transformers", "b12x", "tokens/s")
    spec_case.params = {**common, "mode": "speculative", "reference": plain_check,
                        **{f"vs_plain_{k}": v for k, v in spec_check.items()},
                        **{f"b12x_{k}": last["speculative"][k]
                           for k in ("steps", "tokens_per_step", "acceptance_rate")}}

    def theirs_prefill() -> float:
        start = time.perf_counter()
        reference.prefill()
        return prompt_tokens / (time.perf_counter() - start)

    def ours_prefill() -> float:
        decoder = Decoder(session)
        start = time.perf_counter()
        decoder.prefill(0, prompt)
        return prompt_tokens / (time.perf_counter() - start)

    chunk = package.passes["prefill"].width
    prefill_case = compare_rates("v4_reference.prefill", f"{prompt_tokens} tokens ({label})", theirs_prefill,
                                 ours_prefill, settings, "transformers", "b12x", "tokens/s",
                                 {**common, "chunk": chunk, "b12x_replays": -(-prompt_tokens // chunk),
                                  "first_token_agrees": plain[0] == theirs[0]})
    return [plain_case, spec_case, prefill_case]


@benchmark("v4_reference")
def v4_reference_benchmark(settings: Settings) -> list:
    recipe = fp32_weights(load_recipe(RECIPE))
    weights = init_weights(Dims.from_recipe(recipe), SEED)  # cache formats change no weight
    out = []
    variants = ((recipe, f"{recipe.name}, recipe caches"), (fp32_variant(recipe), f"{recipe.name}, fp32 caches"))
    for variant, label in variants:
        with tempfile.TemporaryDirectory(prefix="b12x-bench-") as tmp:
            package = load(export_package(variant, Path(tmp), weights=weights).path)
        # load() reads every file into memory, so the package outlives its directory.
        out += measure(package, settings, label=label)
        out += measure(package, settings, label=f"{label}, compiled", compiled=True)
    return out
