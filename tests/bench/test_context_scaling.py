"""The context_scaling benchmark works at a reduced size: its rows are well formed.

The full benchmark exports dsv41-tiny four times (max_seq_len 1k to 1M); here two of the
run's shared exports stand in for two of them: the small package (1k) and its 64k variant,
the very recipe `variant` makes (test_context_independence and test_prefix_pages use it
too), so nothing is exported for this module alone. The indexer runs at small committed
lengths. Nothing here asserts a speed.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from b12x_toolchain.exporter.recipe.dims import Dims  # noqa: E402
from b12x_toolchain.runtime import load  # noqa: E402
from benchmarks import context_scaling as cs  # noqa: E402
from benchmarks.registry import REGISTRY, Settings  # noqa: E402
from conftest import LONG_CONTEXT as LONG  # noqa: E402

# Its own time is seconds: the two packages are the run's shared exports, built by the modules
# scheduled before it.
pytestmark = [pytest.mark.slow(minutes=0.1), pytest.mark.usefixtures("one_torch_thread")]

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


def test_an_export_in_the_directory_is_reused_and_a_missing_one_made(small_recipe, long_path, tmp_path, monkeypatch):
    recipe = cs.variant(small_recipe, LONG)
    assert recipe.name == "dsv41-small-64k" == long_path.stem  # the variant the run's shared "long" export is
    weights = cs.shared_weights([small_recipe, recipe])
    made = []

    def export(exported, out, **options):  # export_package, as package_path calls it
        made.append((exported.name, out, options["weights"] is weights, options["jobs"]))
        return SimpleNamespace(path=out / f"{exported.name}.b12x")

    monkeypatch.setattr(cs, "export_package", export)
    # As `--exports DIR` leaves it: DIR/NAME/NAME.b12x, the fused package of the very recipe.
    (tmp_path / recipe.name).symlink_to(long_path.parent, target_is_directory=True)
    assert cs.package_path(recipe, tmp_path, weights, jobs=1) == tmp_path / recipe.name / long_path.name
    assert made == []
    other = cs.variant(small_recipe, 4096)  # nothing of it in the directory: exported there
    assert cs.package_path(other, tmp_path, weights, jobs=3) == tmp_path / other.name / f"{other.name}.b12x"
    assert made == [(other.name, tmp_path / other.name, True, 3)]


def test_model_rows_at_1k_and_64k(small_pkg, long_path):
    rows = cs.model_cases([small_pkg, load(long_path)], ONE_ROUND)
    assert [m.benchmark for m in rows] == ["context_scaling.verify", "context_scaling.draft",
                                           "context_scaling.prefill_chunk"]
    for m in rows:
        check_row(m, m.benchmark, "64k vs 1k", ("max_seq_len 1k", "max_seq_len 64k"))
        assert m.params["max_seq_len"] == [1024, LONG]
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
