"""The tiny recipe's YAML text, and helpers to edit it and to catch the located error it gives."""

from __future__ import annotations

import pytest

from b12x_toolchain.exporter.recipe.loader import RecipeError, parse_recipe
from paths import RECIPES

TINY_TEXT = (RECIPES / "dsv41-tiny.yaml").read_text()


def line_of(text: str, needle: str) -> int:
    """1-based line of the single line of ``text`` that contains ``needle``."""
    hits = [n for n, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(hits) == 1, (needle, hits)
    return hits[0]


def edit(old: str, new: str, text: str = TINY_TEXT) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def parse_error(text: str, file: str = "t.yaml") -> RecipeError:
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, file)
    return info.value
