"""Recipes made from data rather than read from a file: a recipe document (plain data, as
`Recipe.normalized()` gives it) parsed exactly as a user's YAML file is, so every check and
every error's location is the loader's, and a recipe with some of its keys replaced.
"""

from __future__ import annotations

from typing import Any

import yaml

from b12x_toolchain.exporter.recipe.loader import Recipe, parse_recipe

__all__ = ["recipe_from_dict", "recipe_variant"]


def recipe_from_dict(data: dict[str, Any], file: str | None = None) -> Recipe:
    """The recipe document `data`, parsed as a user's YAML file; `file` names it in errors
    (`<name>.yaml` by default).

    Through YAML text, not JSON: PyYAML reads JSON's `1e-20` as a string, but dumps floats it
    can read. Keys are sorted, so the recipe's free-form mappings (a rewrite's expect_matches)
    come out in one order whatever order `data` gives them in.
    """
    return parse_recipe(yaml.safe_dump(data), file=f"{data['name']}.yaml" if file is None else file)


def recipe_variant(base: Recipe, changes: dict[str, Any], name: str | None = None) -> Recipe:
    """`base` with dotted-path keys replaced (`model.max_seq_len`; a list's item by its index,
    `rewrites.0.expect_matches`) and, given `name`, renamed; parsed as a user's YAML file."""
    data = base.normalized()  # fresh data, the recipe's own left as it is
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(leaf) if isinstance(node, list) else leaf] = value
    if name:
        data["name"] = name
    return recipe_from_dict(data)
