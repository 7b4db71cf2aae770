"""Unsupported configurations and bad buffers are refused at export and at bind time."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from b12x_toolchain.exporter.pipeline.export import ExportError, export_package
from b12x_toolchain.exporter.recipe.loader import RecipeError
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.passes.fuse_window_snapshot import FUSE_WINDOW_SNAPSHOT
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.ops.qualify import UnsupportedConfiguration
from b12x_toolchain.runtime.session.validate import BufferError

pytestmark = pytest.mark.slow(minutes=0.4)


def _no_leftovers(directory):
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("changes, key, value", [
    ({"model.window": 64, "cache.history": 64}, "cache.history", "64 is not supported .*qualified: 128"),
    ({"cache.staging.layout": "HND"}, "cache.staging.layout", "'HND' is not supported .*qualified: NHD"),
    ({"cache.staging.page_size": 8}, "cache.staging.page_size", "8 is not supported .*qualified: 16, 32, 64, 128"),
])
def test_recipe_refuses_unqualified_fusion_at_its_key(small_recipe, changes, key, value):
    with pytest.raises(RecipeError, match=rf"dsv41-small.yaml:\d+: {key}: {value}"):
        recipe_variant(small_recipe, changes)


# One unfused package of the one-layer recipe at history 64 and staging HND with 8-token pages:
# each is outside what the fused op is qualified for, so one export serves every test below
# that needs an unqualified graph. The fused op checks history first, so those tests still
# name history 64 in what they match.
# The optional decode pass is left out: nothing here replays it.
UNQUALIFIED = {"model.window": 64, "cache.history": 64, "cache.staging.layout": "HND", "cache.staging.page_size": 8,
               "rewrites": [], "passes.decode": None}


@pytest.fixture(scope="module")
def unqualified(one_layer_recipe, tmp_path_factory):
    recipe = recipe_variant(one_layer_recipe, UNQUALIFIED)
    return recipe, export_package(recipe, tmp_path_factory.mktemp("unqualified"), fuse=False).path


def test_fusion_rewrite_refuses_unqualified_sites_itself(unqualified):
    """Defence in depth: a graph reaching the rewrite with an unqualified site still fails export."""
    from b12x_toolchain.exporter.model.weights import init_weights
    from b12x_toolchain.exporter.pipeline.pass_export import PassJob, export_pass
    from b12x_toolchain.exporter.recipe.dims import Dims
    from b12x_toolchain.runtime.rewrite import RewriteError

    recipe, _ = unqualified
    # The verify pass as export runs it, with the rewrite the recipe may not name: the capture is
    # the fixture's own (trace_cache.py copies it), so only the rewrite runs here.
    job = PassJob(recipe, "verify", ["fuse_window_snapshot"], init_weights(Dims.from_recipe(recipe), 0), None)
    with pytest.raises(ExportError, match=r"rewrite fuse_window_snapshot failed on the verify graph: .*history length 64") as caught:
        export_pass(job)
    assert isinstance(caught.value.__cause__, RewriteError)


def test_recipe_refuses_impossible_match_counts(small_recipe):
    counts = {"prefill": 0, "verify": 3, "draft": 1, "commit": 0, "decode": 0}
    with pytest.raises(RecipeError, match=r"rewrites\[0\]\.expect_matches\.verify: 3 matches are impossible"):
        recipe_variant(small_recipe, {"rewrites.0.expect_matches": counts})


def test_unfused_export_accepts_what_the_fused_op_does_not(unqualified):
    # The unfused ops handle any history and layout; only the fused op is restricted.
    recipe, path = unqualified
    session = load(path).session(slots=1)
    rows = max(recipe.passes.verify.rows_buckets)  # staging is sized for the largest bucket
    # HND: pages of (history 64 + verify's 8 rows) / 8, then the head, then the page's 8 rows.
    assert session.staging["staging.verify.layer0.window"].shape == (rows, 9, 1, 8, 66)


def test_wrong_match_count_fails_export_and_leaves_nothing(one_layer_recipe, tmp_path):
    # Export stops at verify, the first pass with a window snapshot site: one layer's prefill and
    # verify are all it captures.
    recipe = recipe_variant(one_layer_recipe, {"rewrites.0.expect_matches": {"prefill": 0, "verify": 0, "draft": 1, "commit": 0, "decode": 0}})
    with pytest.raises(ExportError, match="found 1 matches in the verify graph; the recipe expects 0"):
        export_package(recipe, tmp_path)
    assert _no_leftovers(tmp_path) == []


def test_session_refuses_a_fused_graph_for_an_unqualified_history(unqualified):
    """A package fused by another tool for history 64 is refused when buffers are bound."""
    package = load(unqualified[1])  # a package of its own: the rewrite below changes its graph
    unchecked = dataclasses.replace(FUSE_WINDOW_SNAPSHOT, check=None)
    assert unchecked(package.passes["verify"].program.graph_module).matches == 1
    with pytest.raises(UnsupportedConfiguration, match=r"pass verify: .*history length 64 .*\[128\]"):
        package.session(slots=1)


@pytest.mark.parametrize("tensor, message", [
    (torch.zeros(2, 128, 66, dtype=torch.float32), r"dtype torch.float32 does not match the expected torch.uint8"),
    (torch.zeros(2, 127, 66, dtype=torch.uint8), r"shape \(2, 127, 66\) does not match the expected \(2, 128, 66\)"),
    (torch.zeros(2, 66, 128, dtype=torch.uint8).transpose(1, 2), r"strides .* are not contiguous"),
    ([0] * 4, r"expected a tensor"),
])
def test_session_refuses_a_wrong_buffer(small_pkg, tensor, message):
    with pytest.raises(BufferError, match=r"cache.layer0.window: " + message):
        small_pkg.session(slots=1, buffers={"cache.layer0.window": tensor})


def test_session_uses_caller_owned_buffers(small_pkg):
    ring = torch.zeros(3, 128, 66, dtype=torch.uint8)
    session = small_pkg.session(slots=2, buffers={"cache.layer0.window": ring})
    assert session.caches["cache.layer0.window"] is ring
    with pytest.raises(BufferError, match="cache.nope: not a cache or staging buffer"):
        small_pkg.session(slots=2, buffers={"cache.nope": ring})


def _caches(session):
    return {k: v.clone() for k, v in session.caches.items()}


@pytest.mark.parametrize("values, message", [
    (dict(slot_ids=[5], positions=[0], accepted_tokens=[1]), r"slot_ids: value 5 is out of range; expected a slot in \[0, 2\)"),
    (dict(slot_ids=[-1], positions=[0], accepted_tokens=[1]), r"slot_ids: value -1 is out of range"),
    (dict(slot_ids=[0, 0], positions=[3, 3], accepted_tokens=[1, 1]), r"slot_ids: \[0, 0\] repeats a slot"),
    (dict(slot_ids=[0], positions=[7], accepted_tokens=[1]), r"positions: \[7\] do not continue the slots' committed lengths \[3\]"),
    (dict(slot_ids=[0], positions=[3], accepted_tokens=[9]), r"accepted_tokens: value 9 is out of range"),
    (dict(slot_ids=[0], positions=[3]), r"missing \['accepted_tokens'\]"),
    (dict(slot_ids=torch.tensor([0], dtype=torch.int64), positions=[3], accepted_tokens=[1]), r"slot_ids: dtype torch.int64"),
])
def test_bad_commit_inputs_are_refused_before_any_write(small_pkg, values, message):
    session = small_pkg.session(slots=2)
    from b12x_toolchain.runtime.serving.speculative import Decoder
    Decoder(session).prefill(0, [1, 2, 3])
    before = _caches(session)
    with pytest.raises(ValueError, match=message):
        session.replay("commit", **values)
    after = _caches(session)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bad_tokens_are_refused(small_pkg):
    session = small_pkg.session(slots=1)
    with pytest.raises(ValueError, match=r"token_ids: value 512 is out of range; expected a token id in \[0, 512\)"):
        session.replay("prefill", token_ids=[[512] + [0] * 63], slot_ids=[0], positions=[0], new_tokens=[1])
    with pytest.raises(ValueError, match=r"token_ids: shape \(1, 5\) does not match the expected \(1, 8\)"):
        session.replay("verify", token_ids=[[1] * 5], slot_ids=[0], positions=[0])
