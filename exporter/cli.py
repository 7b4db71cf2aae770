"""`b12x` command line: export, inspect, run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def _fail(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    sys.exit(1)


@click.group()
@click.version_option(package_name="b12x")
def main():
    """Export speculative-decoding passes as versioned packages and replay them."""


@main.command()
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
        _fail(str(exc))
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
        _fail(str(exc))
    console.print(table)
    console.print(f"wrote [bold]{result.path}[/]  abi {result.abi_fingerprint[:16]}", highlight=False)


@main.command()
@click.argument("package", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(package, as_json):
    """Show a package's passes, calling conventions, ABI fingerprint, rewrites and files."""
    from b12x.runtime import PackageError, load

    try:
        pkg = load(package)
    except PackageError as exc:
        _fail(str(exc))
    manifest = pkg.manifest
    if as_json:
        click.echo(json.dumps(manifest, indent=2, sort_keys=True))
        return
    console.print(f"[bold]{manifest['name']}[/]  format {manifest['format_version']}  op set {manifest['opset_version']}"
                  f"  abi {manifest['abi_fingerprint']}", highlight=False)
    for name, entry in manifest["passes"].items():
        table = Table(title=f"pass {name}: width {entry['width']}, rows buckets {entry['rows_buckets']}")
        for column in ("name", "role", "dtype", "shape"):
            table.add_column(column)
        for spec in entry["inputs"] + entry["outputs"]:
            if spec["role"] != "weight":
                table.add_row(spec["name"], spec["role"], spec["dtype"], str(spec["shape"]))
        weights = sum(1 for s in entry["inputs"] if s["role"] == "weight")
        table.caption = f"+ {weights} weight inputs"
        console.print(table)
    rewrites = Table(title=f"rewrites: {manifest['rewrites']['pipeline'] or 'none'}")
    for column in ("pass", "rewrite", "matches", "nodes before", "nodes after"):
        rewrites.add_column(column)
    for pass_name, results in manifest["rewrites"]["results"].items():
        for rewrite, r in results.items():
            rewrites.add_row(pass_name, rewrite, str(r["matches"]), str(r["nodes_before"]), str(r["nodes_after"]))
    console.print(rewrites)
    files = Table(title="files")
    files.add_column("file")
    files.add_column("sha256")
    for name, digest in manifest["files"].items():
        files.add_row(name, digest)
    console.print(files)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of integer token ids") from None


@main.command()
@click.argument("package", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt-ids", required=True, help="Prompt token ids, comma or space separated.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--greedy", is_flag=True, help="Plain greedy decoding instead of speculative decoding.")
def run(package, prompt_ids, max_new_tokens, greedy):
    """Prefill a prompt and generate tokens on CPU."""
    from b12x.runtime import PackageError, load
    from b12x.runtime.speculative import Decoder
    from b12x.runtime.validate import InputError

    prompt = _parse_ids(prompt_ids)
    try:
        session = load(package).session(device="cpu", slots=1)
        decoder = Decoder(session)
        tokens = decoder.generate([prompt], max_new_tokens, speculative=not greedy)[0]
    except (PackageError, InputError, ValueError) as exc:
        _fail(str(exc))
    click.echo("tokens: " + " ".join(map(str, tokens)))
    stats = Table(title="speculative decoding" if not greedy else "greedy decoding")
    stats.add_column("stat")
    stats.add_column("value", justify="right")
    for key, value in decoder.stats.as_dict().items():
        stats.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(stats)


if __name__ == "__main__":
    main()
