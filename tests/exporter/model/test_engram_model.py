"""Engram in the model equals an eager reference written here from the spec.

The reference hashes with Python integers over the whole sequence, looks rows up by plain
indexing (FP8 rows decoded through torch's own float8 dtypes, then rounded to bf16), and
gates each stream as DeepSeek's reference does. The model's prefill with the reference in
place of its Engram must give the model's own logits: within 1e-5 with fp32 tables, 1e-2
with FP8 tables and projection. Incremental decoding, speculation, fused passes and prefix
snapshots run on the tiny recipe, which has Engram, in the rest of the suite.
"""

from __future__ import annotations

import math

import pytest
import torch

from b12x_toolchain.exporter.model.engram import TOKEN_MAP, hash_primes, prefix
from b12x_toolchain.exporter.model.engram_hashing import layer_multipliers
from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from conftest import random_tokens
from decode_steps import FP32_WEIGHTS, relative_rms, single_forward

LENGTH = 150  # past the window's 128, so the rows' n-grams span everything a pass sees
FP8_ENGRAM = {**FP32_WEIGHTS, "weights": {"engram_tables": {"format": "fp8_e4m3", "block": [1, 32], "scale": "ue8m0"},
                                          "engram_projection": {"format": "fp8_e4m3", "block": [32, 32],
                                                                "scale": "ue8m0"}}}


def reference_rows(d, layer, tokens, token_map):
    """[T, columns] table rows of every token, from the spec with Python integers."""
    e = d.engram
    ids = [int(token_map[t]) for t in tokens]
    m, primes = layer_multipliers(layer, e.max_ngram, e.compressed_vocab), hash_primes(d)[layer]
    offsets = [sum(primes[:c]) for c in range(len(primes))]
    out = []
    for t in range(len(ids)):
        values, blocked = [], False
        for k in range(e.max_ngram):
            blocked = blocked or t - k < 0 or ids[t - k] == -1
            values.append(e.pad_id if blocked else ids[t - k])
        mixed, row = values[0] * m[0], []
        for order in range(1, e.max_ngram):
            mixed ^= values[order] * m[order]
            row += [mixed % primes[c] + offsets[c] for c in range((order - 1) * e.heads, order * e.heads)]
        out.append(row)
    return torch.tensor(out)


def decoded(w, name):
    """A weight's float32 value: fp32 as is, FP8 as data x 2^(scale byte - 127) per block."""
    data = w[name]
    if data.dtype != torch.float8_e4m3fn:
        return data.float()
    scale = w[name + "_scale"]
    block = (data.shape[0] // scale.shape[0] if scale.shape[0] * 32 > data.shape[0] else 32, 32)
    powers = torch.exp2(scale.view(torch.uint8).float() - 127)
    expanded = powers.repeat_interleave(block[0], 0)[: data.shape[0]].repeat_interleave(block[1], 1)
    return data.float() * expanded[:, : data.shape[1]]


def reference_block(d, w, layer, streams, rows):
    """Streams [1, T, N, D] after Engram layer `layer`, from its table rows [T, columns]."""
    p, eps = prefix(layer), d.eps
    table = decoded(w, p + "embed.weight")
    looked_up = table[rows].flatten(-2)  # [T, columns * head_dim]
    if w[p + "embed.weight"].dtype == torch.float8_e4m3fn:
        looked_up = looked_up.to(torch.bfloat16).float()  # the reference's bf16 rows
    kv = looked_up @ decoded(w, p + "wkv.weight").T
    x = streams[0]
    n, dim = x.shape[-2:]
    key, value = kv[:, : n * dim].reshape(-1, n, dim), kv[:, n * dim :]
    gain = w[p + "q_weight"].float() * w[p + "k_weight"].float()
    out = torch.empty_like(x)
    for s in range(n):
        h, k = x[:, s], key[:, s]
        dot = (h * gain[s] * k).sum(-1) / torch.sqrt(h.pow(2).mean(-1) + eps) / torch.sqrt(k.pow(2).mean(-1) + eps)
        dot = dot / math.sqrt(dim)
        g = torch.sigmoid(torch.where(dot < 0, -1.0, 1.0) * torch.sqrt(torch.clamp(dot.abs(), min=1e-6)))
        out[:, s] = h + g[:, None] * value
    return out[None]


class ReferenceEngram:
    """Stands in for the model's Engram: the spec's hashes and blocks."""

    def __init__(self, d, tokens):
        self.d, self.tokens = d, tokens
        self.calls = 0

    def hashes(self, w, io, tokens):
        return {layer: reference_rows(self.d, layer, self.tokens, w[TOKEN_MAP]) for layer in self.d.engram.layer_ids}

    def block(self, w, layer, streams, rows):
        self.calls += 1
        return reference_block(self.d, w, layer, streams, rows)


@pytest.fixture(scope="module")
def tokens():
    return random_tokens(torch.Generator().manual_seed(7), LENGTH)


@pytest.mark.parametrize("changes, bound", [(FP32_WEIGHTS, 1e-5), (FP8_ENGRAM, 1e-2)], ids=["fp32", "fp8"])
def test_prefill_equals_the_reference(tiny_recipe, tokens, changes, bound):
    recipe = recipe_variant(tiny_recipe, changes, name="engram")
    d = Dims.from_recipe(recipe)
    weights = init_weights(d, seed=3)
    assert (weights[prefix(1) + "embed.weight"].dtype == torch.float8_e4m3fn) == (bound > 1e-5)
    reference = {}

    def use_reference(module):
        reference["engram"] = module.engram = ReferenceEngram(module.d, tokens)

    got = single_forward(recipe, weights, tokens)
    want = single_forward(recipe, weights, tokens, use_reference)
    assert reference["engram"].calls == len(d.engram.layer_ids)
    assert relative_rms(got, want) < bound
    # Engram is not a no-op: without its value the logits move far beyond the bound.
    silent = dict(weights)
    for layer in d.engram.layer_ids:
        name = prefix(layer) + "wkv.weight"
        silent[name] = torch.zeros_like(weights[name])
    assert relative_rms(single_forward(recipe, silent, tokens), got) > 10 * bound


def test_tokens_sharing_a_compressed_id_hash_alike(tiny_recipe):
    # The identity-style map folds token ids onto 384 compressed ids: 5 and 389 are one id.
    d = Dims.from_recipe(tiny_recipe)
    token_map = init_weights(d, seed=0)[TOKEN_MAP]
    assert token_map[5] == token_map[389] == 5 and token_map.shape == (d.vocab,)
    one, other = reference_rows(d, 1, [9, 5, 7], token_map), reference_rows(d, 1, [9, 389, 7], token_map)
    assert torch.equal(one, other)
    assert not torch.equal(one, reference_rows(d, 1, [9, 6, 7], token_map))
