"""DeepSeek V4 through b12x matches `transformers`' DeepseekV4ForCausalLM.

The reference is a tiny random `transformers` model saved with save_pretrained; b12x
imports that checkpoint. The reference runs one full forward over the whole sequence; b12x runs the exported
passes through the runtime: chunked prefill, then verify steps of width 8 whose first
1, 7 or 8 rows are committed, far past the attention window and across every
compressor group boundary. fp32 cache formats must agree within 1e-4; the recipe's
quantised formats within the bound derived in `test_quantised_formats_stay_within_bound`.
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.exporter.hf.checkpoint import load_hf_checkpoint
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.ops.opset import ops
from b12x_toolchain.runtime.serving.speculative import Decoder
from conftest import random_tokens
from decode_steps import FP32_CACHES, exported, incremental, prefill, relative_rms
from hf_reference import fp32_tiny_recipe, reference_logits, save_tiny_checkpoint
from same_tokens import assert_same_tokens

pytestmark = pytest.mark.slow(minutes=1.0)  # the module's time on two busy cores: longest runs first

TOLERANCE = 1e-4
SPARSE_ATTENTION = ops.sparse_attention.default


@pytest.fixture(scope="module")
def recipe():
    # The checkpoint transformers saves holds fp32 weights; dsv4-tiny cut to one CSA and one HCA
    # layer (SMALL_V4): every layer kind and the MTP draft, at half the layers' work.
    return fp32_tiny_recipe(small=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Random weights saved by `transformers`' save_pretrained (plus the MTP stage's)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("v4ckpt"), seed=3, small=True)


@pytest.fixture(scope="module")
def weights(recipe, checkpoint):
    """The package's weights come through the checkpoint import, as a user's would."""
    return load_hf_checkpoint(checkpoint.path, Dims.from_recipe(recipe))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return checkpoint.model


@pytest.fixture(scope="module")
def fp32_pkg(recipe, weights, tmp_path_factory):
    return exported(recipe, weights, tmp_path_factory, FP32_CACHES, name="dsv4-small-fp32")


@pytest.fixture(scope="module")
def quantised_pkg(recipe, weights, tmp_path_factory):
    return exported(recipe, weights, tmp_path_factory)


@pytest.fixture(scope="module")
def sequences():
    gen = torch.Generator().manual_seed(21)
    # Two requests of different lengths share each replay (rows 2): 40 and 77 prompt tokens.
    return [random_tokens(gen, 260), random_tokens(gen, 260)], [40, 77]


@pytest.fixture(scope="module")
def expected(reference, sequences):
    return [reference_logits(reference, seq) for seq in sequences[0]]


def test_reference_top_k_is_tie_free(reference, recipe, sequences):
    """The comparison is only sharp if the indexer really drops entries and no two scores
    tie at the top-k boundary (ReLU zeros could; top-k then depends on row width)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

    scores = []
    hooks = [m.register_forward_hook(lambda mod, args, out: scores.append(out[0].detach()))
             for m in reference.modules() if isinstance(m, DeepseekV4IndexerScorer)]
    try:
        reference_logits(reference, sequences[0][0])
    finally:
        for h in hooks:
            h.remove()
    k, ratio = recipe.model.indexer.topk, recipe.model.csa_ratio
    gaps, dropping = [], 0
    for layer_scores in scores:  # [S, T]
        for t in range(layer_scores.shape[0]):
            visible = layer_scores[t, : (t + 1) // ratio].sort(descending=True).values
            if visible.numel() > k:
                dropping += 1
                gaps.append((visible[k - 1] - visible[k]).item())
    assert scores and dropping > 100, "the indexer never had more visible entries than top-k"
    print(f"{dropping} queries chose {k} of more entries; smallest boundary gap {min(gaps):.3g}")
    assert min(gaps) > 1e-4


def test_prefill_logits_match_reference(fp32_pkg, expected, sequences):
    session = fp32_pkg.session(slots=1, max_rows=1)
    seq = sequences[0][0][:200]  # two chunks of 128: the last one partial
    got = prefill(session, 0, seq)
    err = (got - expected[0][:200]).abs().max().item()
    print(f"prefill 200 tokens: max |Δlogit| {err:.3g}")
    assert err < TOLERANCE


def test_incremental_logits_match_reference(fp32_pkg, recipe, expected, sequences):
    got = incremental(fp32_pkg, *sequences)
    window = recipe.model.window
    for slot, (ours, ref) in enumerate(zip(got, expected)):
        n = ours.shape[0]
        assert n >= window + 150, f"request {slot} covered only {n} positions"
        err = (ours - ref[:n]).abs().max().item()
        print(f"request {slot}: {n} positions, max |Δlogit| {err:.3g}")
        assert err < TOLERANCE



def test_prefill_and_decode_attend_only_the_history_a_query_can_see(fp32_pkg, recipe):
    """The ring keeps `history` rows (verify snapshots them all for commit), but a query sees
    only the window - 1 positions before it, so the passes that read the ring directly
    gather those and no more; the logits tests above hold the result to the reference."""
    d = Dims.from_recipe(recipe)
    assert d.history > d.window - 1  # dsv4-tiny keeps more history than its window shows
    for name, history in (("prefill", d.window - 1), ("decode", d.window - 1), ("verify", d.history)):
        info = fp32_pkg.passes[name]
        keys = [n.args[1].meta["val"].shape[1] for n in info.program.graph.nodes if n.target == SPARSE_ATTENTION]
        assert keys == [history + info.width] * len(d.ratios), name


def test_quantised_formats_stay_within_bound(quantised_pkg, recipe, expected, sequences):
    """OCP MXFP8 cache rows (dsv4-tiny's ocp_mxfp8): every element within relative ε = 2^-4.

    E4M3 keeps 3 mantissa bits, so round-to-nearest moves a value by at most half a unit
    in the last place, 2^-4 relative; the block's power-of-two scale keeps the block
    maximum normal. Each of the L quantised layers adds noise of that relative size to
    the keys (= values) it reads, and the normalised residual streams carry it on without
    growth, so the logits' RMS error relative to their RMS stays within sqrt(L) * ε. A
    maximum over positions is not bounded: the indexer's top-k and the MoE routing are
    discontinuous, and noise of that size flips a choice at a few positions.
    """
    eps = 2.0 ** -4
    layers = len(recipe.model.target_ratios)
    bound = layers ** 0.5 * eps
    for slot, (ours, ref) in enumerate(zip(incremental(quantised_pkg, *sequences), expected)):
        ref = ref[: ours.shape[0]]
        err = relative_rms(ours, ref)
        print(f"request {slot}: relative RMS logit error {err:.3g} (bound {bound:.3g})")
        assert err <= bound
        assert err > 1e-3  # the formats are really on the path: fp32 caches give ~1e-6


# --- speculative decoding ---------------------------------------------------------------

def test_speculation_equals_greedy(quantised_pkg, sequences):
    """The MTP draft pass, and a drafter that is right for 0..7 tokens, give greedy's tokens."""
    prompts = [seq[:n] for seq, n in zip(*sequences)]
    greedy = Decoder(quantised_pkg.session(slots=2, max_rows=2))
    want = greedy.generate(prompts, 40, speculative=False)
    mtp = Decoder(quantised_pkg.session(slots=2, max_rows=2))
    got = mtp.generate(prompts, 40)
    gen = torch.Generator().manual_seed(5)
    counts = set()

    def drafter(rows):
        out = []
        for row in rows:
            done, right = len(row.tokens), int(torch.randint(0, 8, (1,), generator=gen))
            truth = want[row.slot][done : done + 7]
            counts.add(min(right, len(truth)))
            out.append((truth[:right] + [(t + 1) % 512 for t in truth[right:]] + [0] * 7)[:7])
        return out

    oracle = Decoder(quantised_pkg.session(slots=2, max_rows=2), drafter=drafter)
    right = oracle.generate(prompts, 40)
    for slot in range(2):
        assert_same_tokens(got[slot], want[slot], f"MTP request {slot}")
        assert_same_tokens(right[slot], want[slot], f"oracle request {slot}")
    assert mtp.stats.drafted >= 7 * mtp.stats.steps
    assert {0, 7} <= counts and oracle.stats.as_dict()["tokens_per_step"] > 1.5
