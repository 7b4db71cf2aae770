"""The context_scaling benchmark works at a reduced size: its rows are well formed.

The full benchmark exports dsv41-tiny four times (max_seq_len 1k to 1M); here the shared
small package (1k) is compared with a 4k variant of it exported once, and the indexer runs
at small committed lengths. Nothing here asserts a speed.
"""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import pytest
import torch

from paths import ROOT

if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not an installed package
    sys.path.append(str(ROOT))  # after tests/: its packages must not be shadowed

from b12x_toolchain.exporter.recipe.dims import Dims  # noqa: E402
from b12x_toolchain.runtime import load  # noqa: E402
from benchmarks import context_scaling as cs  # noqa: E402
from benchmarks.registry import REGISTRY, Settings  # noqa: E402

pytestmark = [pytest.mark.slow(minutes=0.3), pytest.mark.usefixtures("one_torch_thread")]

ONE_ROUND = Settings(repeat=1, warmup=0)


def check_row(m, benchmark: str, case: str, labels: tuple[str, str]) -> None:
    assert (m.benchmark, m.case) == (benchmark, case)
    assert (m.baseline_label, m.candidate_label) == labels
    assert m.unit == "ms" and m.baseline > 0 and m.candidate > 0
    assert m.ratio == pytest.approx(m.candidate / m.baseline, rel=1e-12)
    assert len(m.baseline_samples) == len(m.candidate_samples) == 1
    assert m.to_json()["params"] == m.params  # JSON-ready, as the runner writes it


def test_registered_and_variants_differ_only_in_max_seq_len(tiny_recipe):
    assert REGISTRY["context_scaling"] is cs.context_scaling_benchmark
    recipes = [cs.variant(tiny_recipe, n) for n in cs.MAX_SEQ_LENS]
    assert [r.name for r in recipes] == ["dsv41-tiny-1k", "dsv41-tiny-16k", "dsv41-tiny-256k", "dsv41-tiny-1m"]
    for recipe, n in zip(recipes, cs.MAX_SEQ_LENS):
        expected = copy.deepcopy(tiny_recipe.normalized())
        expected["model"]["max_seq_len"], expected["name"] = n, recipe.name
        assert recipe.normalized() == expected
    cs.shared_weights(recipes)  # raises if the weights' shapes depended on max_seq_len
    assert max(cs.INDEXER_COMMITTED) <= cs.INDEXER_CAPACITIES[0]


def test_model_rows_at_1k_and_4k(small_recipe, small_path, tmp_path, monkeypatch):
    recipe_4k = cs.variant(small_recipe, 4096)
    weights = cs.shared_weights([small_recipe, recipe_4k])
    path = cs.package_path(recipe_4k, tmp_path, weights, jobs=1)
    pkg_4k = load(path)

    def no_export(*args, **kwargs):
        raise AssertionError("the package in the directory should have been reused")

    monkeypatch.setattr(cs, "export_package", no_export)
    assert cs.package_path(recipe_4k, tmp_path, weights, jobs=1) == path  # as `--exports DIR` reuses it

    rows = cs.model_cases([load(small_path), pkg_4k], ONE_ROUND)
    assert [m.benchmark for m in rows] == ["context_scaling.verify", "context_scaling.draft",
                                           "context_scaling.prefill_chunk"]
    for m in rows:
        check_row(m, m.benchmark, "4k vs 1k", ("max_seq_len 1k", "max_seq_len 4k"))
        assert m.params["max_seq_len"] == [1024, 4096]
        assert m.params["outputs_identical"] is True  # checked before timing: same tokens and outputs
        small_bytes, large_bytes = m.params["slot_cache_bytes"]
        assert 0 < small_bytes < large_bytes
    verify, draft, prefill = rows
    assert verify.params["committed"] == draft.params["committed"] == cs.PROMPT_TOKENS
    assert (verify.params["width"], draft.params["width"]) == (8, 7)
    assert prefill.params["chunks"] == 3 and prefill.params["prompt"] == cs.PROMPT_TOKENS


def test_indexer_rows(tiny_recipe):
    d = Dims.from_recipe(tiny_recipe)
    rows = cs.indexer_cases(d, ONE_ROUND, committed=(256, 512, 1024), capacities=(1024, 4096))
    assert len(rows) == 3
    check_row(rows[0], "context_scaling.indexer", "committed 512 vs 256", ("committed 256", "committed 512"))
    check_row(rows[1], "context_scaling.indexer", "committed 1k vs 256", ("committed 256", "committed 1k"))
    check_row(rows[2], "context_scaling.indexer", "capacity 4k vs 1k at committed 256",
              ("capacity 1k", "capacity 4k"))
    assert [m.params["linear_ratio"] for m in rows[:2]] == [2, 4]
    assert rows[2].params["capacity"] == [1024, 4096] and rows[2].params["outputs_identical"] is True
    for m in rows:
        assert (m.params["dim"], m.params["topk"], m.params["format"]) == (d.index_head_dim, d.index_topk,
                                                                          d.index_format)
    with pytest.raises(ValueError, match="cannot hold"):
        cs.indexer_cases(d, ONE_ROUND, committed=(256, 2048), capacities=(1024, 4096))


def test_different_weights_or_outputs_are_refused():
    weights = {"w": torch.zeros(2)}
    same = SimpleNamespace(weights={"w": torch.zeros(2)}, manifest=SimpleNamespace(name="b"))
    other = SimpleNamespace(weights={"w": torch.ones(2)}, manifest=SimpleNamespace(name="c"))
    base = SimpleNamespace(weights=weights, manifest=SimpleNamespace(name="a"))
    cs.check_weights([base, same])
    with pytest.raises(RuntimeError, match="weights differ"):
        cs.check_weights([base, other])
    cs.check_same("verify", {"logits": torch.zeros(3)}, {"logits": torch.zeros(3)})
    with pytest.raises(RuntimeError, match="not comparable"):
        cs.check_same("verify", {"logits": torch.ones(3)}, {"logits": torch.zeros(3)})


def test_size_labels():
    assert [cs.size_label(n) for n in (256, 1024, 16384, 262144, 1 << 20, 3 << 20, 1000)] == \
        ["256", "1k", "16k", "256k", "1M", "3M", "1000"]
