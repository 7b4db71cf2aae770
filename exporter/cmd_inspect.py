"""`b12x inspect`: what a package holds."""

from __future__ import annotations

import json

import click
from rich.table import Table

from b12x.exporter.cli_common import console, fail


@click.command()
@click.argument("package", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(package, as_json):
    """Show a package's passes, calling conventions, ABI fingerprint, rewrites and files."""
    from b12x.runtime import PackageError, load

    try:
        pkg = load(package)
    except PackageError as exc:
        fail(str(exc))
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
