"""DeepSeek V4.1 (not in `transformers`) checked against itself and its formats.

The reference is a single forward over the whole sequence: the eager prefill module of a
variant whose history and prefill chunk hold every position at once, with fp32 caches.
The package runs the same weights incrementally through the runtime — prefill chunks,
verify steps committing 1, 7 or 8 rows, past the 128-token window and across every
ratio-2 group boundary — with fp32 caches (equal within 1e-5) and with the recipe's
MXFP8 / NVFP4 formats (within the bound derived in the test).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import paging
from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.ops.namespace import NAMESPACE
from conftest import random_tokens
from decode_steps import incremental, relative_rms, single_forward

pytestmark = pytest.mark.slow(minutes=0.5)  # the module's time on two busy cores: longest runs first

LENGTH = 360


@pytest.fixture(scope="module")
def weights(tiny_recipe):
    # The recipe's own seed: the quantised package is then the session's fused package.
    return init_weights(Dims.from_recipe(tiny_recipe), seed=tiny_recipe.model.init_seed)


@pytest.fixture(scope="module")
def sequences():
    gen = torch.Generator().manual_seed(31)
    return [random_tokens(gen, LENGTH), random_tokens(gen, LENGTH)], [40, 77]


@pytest.fixture(scope="module")
def expected(tiny_recipe, weights, sequences):
    return [single_forward(tiny_recipe, weights, seq) for seq in sequences[0]]


@pytest.fixture(scope="module")
def fp32_pkg(fp32_path):
    return load(fp32_path)  # exported with the recipe's own weights, as `weights` are


@pytest.fixture(scope="module")
def quantised_pkg(fused_pkg):
    return fused_pkg  # the tiny recipe exported with its own weights, as `weights` are


def test_incremental_equals_single_forward(fp32_pkg, tiny_recipe, expected, sequences):
    for slot, (ours, ref) in enumerate(zip(incremental(fp32_pkg, *sequences), expected)):
        n = ours.shape[0]
        assert n >= tiny_recipe.model.window + 150
        err = (ours - ref[:n]).abs().max().item()
        print(f"request {slot}: {n} positions, max |Δlogit| {err:.3g}")
        assert err < 1e-5


def test_quantised_formats_stay_within_bound(quantised_pkg, tiny_recipe, expected, sequences):
    """Each quantised read adds noise of relative size ε to what a layer attends to or ranks
    with, derived from the V4.1 records' rules (formats/dsv41.py):

    * window rows (dsv41_mxfp8): the scale 2^e is the power of two at or above amax / 448, so
      the block maximum lands in (224, 448] * 2^e and no element saturates (bar < 2^-21 in
      blocks a few ulps above 448 * 2^k). E4M3 keeps 3 mantissa bits: a normal element moves
      by at most 2^-4 of itself, a subnormal one by at most 2^-10 * 2^e < 2^-17 amax. ε = 2^-4.
    * compressed entries (dsv41_nvfp4): s = E4M3(max(amax, 6 * 2^-9) / 6) is within 2^-4 of
      amax / 6 while normal, so |x / s| <= 6.4 and saturation costs under 2^-2 |x|; E2M1's
      1 mantissa bit moves |x / s| >= 1 by at most 2^-2 of itself and smaller ones by at most
      s / 4 (blocks below 6 * 2^-10 round to zeros). ε = 2^-2.
    * index keys (ocp_mxfp4): E2M1 under a power-of-two scale, ε = 2^-2.

    The normalised residual streams carry independent noise on without growth, so the
    logits' RMS error relative to their RMS stays within sqrt(sum of ε^2 over reads). A
    maximum over positions is not bounded: the indexer's top-k and MoE routing are
    discontinuous."""
    d = Dims.from_recipe(tiny_recipe)
    compressed = [i for i in range(d.layers) if d.ratios[i]]
    ranking = [i for i in compressed if d.role(i) in ("full", "reindex")]
    bound = (d.layers * 2.0 ** -8 + len(compressed) * 2.0 ** -4 + len(ranking) * 2.0 ** -4) ** 0.5
    for slot, (ours, ref) in enumerate(zip(incremental(quantised_pkg, *sequences), expected)):
        err = relative_rms(ours, ref[: ours.shape[0]])
        print(f"request {slot}: relative RMS logit error {err:.3g} (bound {bound:.3g})")
        assert 1e-3 < err <= bound  # and the formats really are on the path


# --- CSA2 roles and cache sizes ---------------------------------------------------------

def _buffers_touched(pkg, pass_name):
    """Names of the caches and staging buffers every op-set op of a pass graph reads or writes."""
    info = pkg.passes[pass_name]
    names = dict(zip(info.program.graph_signature.user_inputs, (s.name for s in info.inputs)))
    touched = []
    for node in info.program.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith(f"{NAMESPACE}."):
            touched += [names[a.name] for a in node.args if isinstance(a, torch.fx.Node) and a.name in names
                        and names[a.name].startswith(("cache.", "staging."))]
    return touched


def test_each_layer_touches_only_the_caches_its_role_owns(fused_pkg, tiny_recipe):
    from b12x_toolchain.exporter.model.buffers import owned_caches

    d = Dims.from_recipe(tiny_recipe)
    assert set(d.roles) == {"window", "full", "reindex", "reuse"}  # the tiny recipe has every role
    owned = {name for i in range(d.layers) for name, *_ in owned_caches(d, i)}
    for pass_name in ("prefill", "verify", "commit"):
        touched = _buffers_touched(fused_pkg, pass_name)
        per_layer = {}
        for name in touched:
            parts = name.split(".")
            layer = [p for p in parts if p.startswith("layer")]
            if layer:
                per_layer.setdefault(int(layer[0][5:]), set()).add(parts[-1])
        for i in range(d.layers):
            want = {name.split(".")[-1] for name, *_ in owned_caches(d, i)}
            assert per_layer.get(i) == want, f"{pass_name}: layer {i} ({d.role(i)}) touches {per_layer.get(i)}"
            if d.role(i) in ("reuse", "reindex"):
                assert want == {"window"}  # never a cache it does not own
        assert {n.split(".", 1)[1] for n in touched if n.startswith("cache.layer")} <= owned
    # One write per prefill, and one sparse read for each layer attending to a Full layer's
    # entries (itself, its Reindex and Reuse layers): attention reads the chosen entries
    # straight from the cache, nothing gathers them all.
    prefill = _buffers_touched(fused_pkg, "prefill")
    for i in range(d.layers):
        if d.role(i) == "full":
            readers = sum(1 for j in range(d.layers) if d.ratios[j] and d.kv_source[j] == i)
            assert readers >= 2 and prefill.count(f"cache.layer{i}.compressed") == 1 + readers


def test_full_size_cache_bytes_per_token():
    """V4.1-Flash: MXFP8 window rows of 528 bytes, NVFP4 entries of 288, MXFP4 index keys of
    68; long term 3 ratio-2 Full layers x 144 + one ratio-1 Full layer x 288 + index keys
    (3 x 34 + 68) = 890 bytes per token, as the published record sizes give."""
    from b12x_toolchain.exporter.recipe.loader import load_recipe

    d = Dims.from_recipe(load_recipe("dsv41"))
    specs = {s.name: s for s in PASSES["prefill"](d).caches()}
    per_token = 0.0
    for name, spec in specs.items():
        if name.endswith(".window"):
            assert spec.shape[-1] == 528
        elif name.endswith(".compressed") or name.endswith(".index"):  # paged: [pool, page_bytes]
            page = spec.info.page
            assert page.record_bytes == (288 if name.endswith(".compressed") else 68)
            assert spec.shape == (page.pool, page.page_bytes) and page.tokens_per_page == 256
            per_token += page.page_bytes / page.tokens_per_page
    assert sorted(n for n in specs if n.endswith(".compressed")) == [f"cache.layer{i}.compressed" for i in (14, 2, 20, 8)]
    assert per_token == 3 * 144 + 288 + 3 * 34 + 68 == 890


# --- DSpark ---------------------------------------------------------------------------------

def _draft(module, weights, caches, staging, tokens):
    one = torch.tensor([0], dtype=torch.int32)
    with torch.no_grad():
        return module(weights, caches, staging, {"tokens": torch.tensor([tokens], dtype=torch.int32),
                                                 "row_ids": one, "positions": one * 0 + 50})


def test_dspark_markov_bias_chains_left_to_right(tiny_recipe, weights):
    """Row j's logits are the block's logits plus the Markov bias of row j-1's chosen token
    (the anchor for row 0): removing the bias leaves exactly the unbiased logits."""
    d = Dims.from_recipe(tiny_recipe)
    module = PASSES["draft"](d)
    inputs, _ = module.convention()
    buffers = {s.name: torch.zeros(s.resolve(paging.symbols(inputs, 2, 1)), dtype=s.torch_dtype) for s in inputs
               if s.role in ("cache", "staging")}
    caches = {k: v for k, v in buffers.items() if k.startswith("cache.")}
    staging = {k: v for k, v in buffers.items() if k.startswith("staging.")}
    block = [7] + [d.noise_token_id] * (d.draft_width - 1)
    biased = _draft(module, weights, caches, staging, block)
    plain = _draft(module, {**weights, "dspark.markov.out.weight": torch.zeros_like(weights["dspark.markov.out.weight"])},
                   caches, staging, block)
    assert torch.equal(biased["confidence"], plain["confidence"])
    assert ((biased["confidence"] > 0) & (biased["confidence"] < 1)).all()
    chosen = biased["logits"][0].argmax(-1).tolist()
    for j, prev in enumerate([block[0]] + chosen[:-1]):
        bias = weights["dspark.markov.out.weight"] @ weights["dspark.markov.embed"][prev]
        torch.testing.assert_close(biased["logits"][0, j] - plain["logits"][0, j], bias, rtol=0, atol=1e-5)


def test_low_confidence_ends_the_block_and_output_stays_greedy(fused_pkg):
    """With a threshold above every row's confidence the block ends at row 0 (no drafts);
    at 0 every row is kept. Either way the tokens are plain greedy's."""
    from b12x_toolchain.runtime.serving.speculative import Decoder

    gen = torch.Generator().manual_seed(3)
    prompts = [random_tokens(gen, 60), random_tokens(gen, 140)]
    greedy = Decoder(fused_pkg.session(slots=2, max_rows=2)).generate(prompts, 24, speculative=False)
    saved = fused_pkg.manifest
    try:
        for threshold, keeps_drafts in ((0.0, True), (0.999999, False)):
            model = dataclasses.replace(saved.model, confidence_threshold=threshold)
            fused_pkg.manifest = dataclasses.replace(saved, model=model)
            decoder = Decoder(fused_pkg.session(slots=2, max_rows=2))
            assert decoder.generate(prompts, 24) == greedy
            drafted = decoder.stats.drafted
            assert (drafted >= 7 * decoder.stats.steps and drafted % 7 == 0) if keeps_drafts else drafted == 0
    finally:
        fused_pkg.manifest = saved
