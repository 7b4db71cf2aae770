"""Fuzz recipe text: any byte-level edit gives a Recipe or a RecipeError, nothing else."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from b12x_toolchain.exporter.recipe.loader import Recipe, RecipeError, parse_recipe
from paths import RECIPES

TINY = (RECIPES / "dsv41-tiny.yaml").read_text()
ALPHABET = st.sampled_from(list("{}[]:,-&*!|>'\"#%@`\t\n 0123456789.eE+abcxyz\\\x00\x85\u2028"))


@settings(max_examples=150, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, len(TINY)), st.integers(0, 8), st.text(ALPHABET, max_size=6)),
                      min_size=1, max_size=4))
def test_text_mutations_only_raise_recipe_errors(edits):
    text = TINY
    for position, cut, insert in edits:
        position = min(position, len(text))
        text = text[:position] + insert + text[position + cut:]
    try:
        result = parse_recipe(text, "fuzz.yaml")
    except RecipeError as exc:
        assert str(exc).startswith("fuzz.yaml")
    else:
        assert isinstance(result, Recipe)
