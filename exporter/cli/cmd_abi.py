"""`b12x abi diff A B`: the calling-convention differences of two packages (the ABI gate)."""

from __future__ import annotations

import click

from b12x_toolchain.exporter.cli.common import fail


@click.group()
def abi():
    """Compare packages' calling conventions."""


@abi.command()
@click.argument("a", type=click.Path(exists=True))
@click.argument("b", type=click.Path(exists=True))
def diff(a, b):
    """Print how B's calling conventions differ from A's; exit 1 if they differ.

    A and B are package directories or their manifest.json files (a committed manifest
    stands for the package CI exported before).
    """
    from b12x_toolchain.exporter.compare.abi_diff import diff_manifests
    from b12x_toolchain.runtime import PackageError
    from b12x_toolchain.runtime.package.reader import read_manifest

    try:
        manifest_a, manifest_b = read_manifest(a), read_manifest(b)
    except PackageError as exc:
        fail(str(exc))
    lines = diff_manifests(manifest_a.to_json(), manifest_b.to_json())  # a diff of the documents as written
    fp_a, fp_b = manifest_a.abi_fingerprint, manifest_b.abi_fingerprint
    if not lines and fp_a == fp_b:
        click.echo(f"ABI identical: {fp_a}")
        return
    for line in lines or ["calling conventions are equal but the fingerprints differ"]:
        click.echo(line)
    click.echo(f"ABI differs: {len(lines)} change(s); {fp_a[:16]} -> {fp_b[:16]}", err=True)
    raise SystemExit(1)
