"""The recipe's `parallel` section: refused at its own line when the model cannot be split so."""

from __future__ import annotations

import pytest

from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe, parse_recipe
from paths import RECIPES
from recipe_text import TINY_TEXT, edit, line_of, parse_error


def with_parallel(section: str, text: str = TINY_TEXT) -> str:
    return text + "parallel: " + section + "\n"


@pytest.mark.parametrize("section, changes, key, fragment", [
    ("{tensor: 2, expert: 4}", {}, "parallel.tensor", "2 is neither 1 nor the world size 4"),
    ("{tensor: 4}", {}, "parallel.tensor", "4 does not divide model.num_heads (heads are split whole) = 2"),
    ("{tensor: 2}", {"o_groups: 2": "o_groups: 1"}, "parallel.tensor", "2 does not divide model.o_groups"),
    ("{expert: 8}", {}, "parallel.expert", "8 does not divide model.moe.experts (each rank holds whole experts) = 4"),
    ("{tensor: 2}", {"intermediate_size: 128\n    hash": "intermediate_size: 129\n    hash"}, "parallel.tensor",
     "2 does not divide model.moe.intermediate_size (routed experts split by intermediate dimension) = 129"),
    ("{tensor: 0}", {}, "parallel.tensor", "greater than 0"),
    ("{tensor: 2, pipeline: 2}", {}, "parallel.pipeline", "unknown key 'pipeline'"),
])
def test_a_split_the_model_cannot_take_is_refused_at_its_line(section, changes, key, fragment):
    text = TINY_TEXT
    for old, new in changes.items():
        text = edit(old, new, text)
    text = with_parallel(section, text)
    err = parse_error(text)
    assert (err.line, err.key_path) == (line_of(text, "parallel:"), key), str(err)
    assert fragment in str(err), str(err)


def test_mapping_reaches_the_model_dims_and_one_device_keeps_its_digest():
    tiny = load_recipe("dsv41-tiny")
    both = parse_recipe(with_parallel("{tensor: 2, expert: 2}"), "t.yaml")
    d = Dims.from_recipe(both)
    assert (d.tensor, d.expert, d.world_size) == (2, 2, 2)
    assert Dims.from_recipe(tiny).world_size == 1
    # A recipe without the section normalises (and hashes) as it did before the section existed.
    assert "parallel" not in tiny.normalized() and both.normalized()["parallel"] == {"tensor": 2, "expert": 2}
    assert both.sha256() != tiny.sha256()


def test_full_size_recipe_splits_eight_ways():
    text = with_parallel("{tensor: 8, expert: 8}", (RECIPES / "dsv41.yaml").read_text())
    assert Dims.from_recipe(parse_recipe(text, "dsv41.yaml")).world_size == 8
