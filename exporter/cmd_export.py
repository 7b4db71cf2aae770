"""`b12x export`: capture, rewrite and write a package."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from b12x.exporter.cli_common import console, fail


@click.command()
@click.option("--recipe", "recipe_source", required=True, help="Bundled recipe name (dsv41-tiny) or a YAML path.")
@click.option("--out", "out_dir", default="out", show_default=True, type=click.Path(file_okay=False),
              help="Directory the NAME.b12x package is written into.")
@click.option("--no-fuse", is_flag=True, help="Skip the rewrite pipeline (reference package).")
def export(recipe_source, out_dir, no_fuse):
    """Capture every pass of a recipe, rewrite it and write a package."""
    from b12x.exporter.export import ExportError, export_package
    from b12x.exporter.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(recipe_source)
    except RecipeError as exc:
        fail(str(exc))
    table = Table(title=f"{recipe.name}: passes")
    for column in ("pass", "rewrite", "matches", "nodes before", "nodes after"):
        table.add_column(column, justify="left" if column in ("pass", "rewrite") else "right")

    def on_pass(name, records):
        console.print(f"captured [bold]{name}[/]", highlight=False)
        if not records:
            table.add_row(name, "-", "-", "-", "-")
        for r in records:
            table.add_row(name, r.name, str(r.matches), str(r.nodes_before), str(r.nodes_after))

    try:
        result = export_package(recipe, Path(out_dir), fuse=not no_fuse, on_pass=on_pass)
    except (ExportError, ValueError) as exc:
        fail(str(exc))
    console.print(table)
    console.print(f"wrote [bold]{result.path}[/]  abi {result.abi_fingerprint[:16]}", highlight=False)
