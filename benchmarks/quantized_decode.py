"""Greedy decode tokens/s of `dsv41-tiny` with its weights as the V4.1 release stores them,
against its fp32 twin (quantized_recipes.py), on CPU.

Three exports: the fp32 twin and the quantized recipe under each activation rule (`none`:
activations used as they are; `deepseek`: E4M3 per token per 128 channels before every FP8 /
FP4 linear). Each package decodes NEW_TOKENS tokens after a PROMPT_TOKENS prompt on slot 0,
one decode-pass replay per token (the Decoder's non-speculative loop); the rate leaves the
prefill out. Rows are rates with ratio = quantized / fp32 twin: above 1, the quantized
package decodes faster. Each rule is measured uncompiled and compiled (`compile=` on the
session, the decode pass lowered by Inductor during an untimed first stream, so no timed
round includes a compilation); the twin is replayed the same way in the same rounds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from b12x_toolchain.runtime import load
from benchmarks.quantized_recipes import ACTIVATIONS, exported, twins
from benchmarks.registry import Measurement, Settings, benchmark, compare_rates
from benchmarks.v4_reference import b12x_decode

PROMPT_TOKENS = 64  # one prefill chunk
NEW_TOKENS = 33  # the first from prefill, then 32 decoded
SEED = 0
TWIN = "fp32 twin"


def _stream(session, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    tokens, seconds, _ = b12x_decode(session, prompt, new_tokens)
    return tokens[:new_tokens], (len(tokens) - 1) / seconds  # the first token came from prefill


def measure(packages: dict, settings: Settings, compiled: tuple[bool, ...] = (False, True),
            prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS) -> list[Measurement]:
    """packages: TWIN -> the fp32 package, activation rule -> its quantized package (loaded)."""
    twin = packages[TWIN]
    prompt = torch.randint(0, twin.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(SEED)).tolist()
    rows = []
    for compile_ in compiled:
        sessions, streams = {}, {}
        for label, package in packages.items():
            sessions[label] = package.session(device="cpu", slots=1, compile=("decode",) if compile_ else False)
            streams[label] = _stream(sessions[label], prompt, new_tokens)[0]  # untimed: compiles, if compiling
        for rule in (label for label in packages if label != TWIN):
            weights = package_weights(packages[rule])
            row = compare_rates("quantized_decode", f"activation {rule}, {'compiled' if compile_ else 'uncompiled'}",
                                lambda: _stream(sessions[TWIN], prompt, new_tokens)[1],
                                lambda rule=rule: _stream(sessions[rule], prompt, new_tokens)[1],
                                settings, TWIN, f"quantized ({rule})", "tokens/s")
            row.params = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "compiled_replay": compile_,
                          "activation": rule, "formats": weights, "tokens_agree_with_twin": streams[rule] == streams[TWIN],
                          "weight_bytes": sum(t.nbytes for t in packages[rule].weights.values()),
                          "twin_weight_bytes": sum(t.nbytes for t in twin.weights.values())}
            rows.append(row)
    return rows


def package_weights(package) -> list[str]:
    """The storage formats the package's weights use (fp32 left out)."""
    return sorted({f.describe() for f in package.manifest.weights.formats.values()})


@benchmark("quantized_decode")
def run(settings: Settings) -> list[Measurement]:
    with tempfile.TemporaryDirectory(prefix="b12x-quantized-decode-") as scratch:
        folder = Path(settings.exports or scratch)
        folder.mkdir(parents=True, exist_ok=True)
        packages = {}
        for rule in ACTIVATIONS:
            quantized, fp32 = twins({}, "dsv41-tiny", rule)
            packages.setdefault(TWIN, load(exported(fp32, folder)))
            packages[rule] = load(exported(quantized, folder))
        # load() reads every file into memory, so the packages outlive their directory.
    return measure(packages, settings)
