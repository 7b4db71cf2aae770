"""`b12x verify A B`: replay two packages side by side and compare what they write."""

from __future__ import annotations

import click
from rich.table import Table

from b12x_toolchain.exporter.cli.common import console, fail


@click.command()
@click.argument("a", type=click.Path(exists=True, file_okay=False))
@click.argument("b", type=click.Path(exists=True, file_okay=False))
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random inputs.")
@click.option("--trials", default=1, show_default=True, type=click.IntRange(min=1),
              help="Rounds over every pass and rows bucket; caches carry over between rounds.")
@click.option("--atol", type=click.FloatRange(min=0), help="Compare values within this absolute tolerance "
              "(floats directly, encoded cache rows decoded) instead of byte for byte.")
@click.option("--rtol", type=click.FloatRange(min=0), help="Relative tolerance, as --atol.")
@click.option("--weights", "checkpoint", type=click.Path(exists=True, file_okay=False),
              help="Checkpoint directory to bind the weights of a structural package from.")
def verify(a, b, seed, trials, atol, rtol, checkpoint):
    """Replay packages A and B on the same random inputs for every pass and rows bucket,
    reusable storage poisoned first, and compare outputs, staging and persistent caches.
    Exit 1 on any difference."""
    from b12x_toolchain.exporter.compare.package_verify import Tolerance, verify_packages
    from b12x_toolchain.runtime import load
    from b12x_toolchain.runtime.package.reader import read_manifest

    tolerance = Tolerance(atol or 0.0, rtol or 0.0) if atol is not None or rtol is not None else None
    try:
        # --weights binds only structural packages; a full package replays its own weights.
        external = [read_manifest(path).weights.external for path in (a, b)]
        packages = [load(path, weights=checkpoint if ext else None) for path, ext in zip((a, b), external)]
        checks = verify_packages(*packages, seed=seed, trials=trials, tolerance=tolerance)
    except ValueError as exc:  # PackageError, VerifyError, or an input B's rows buckets cannot take
        fail(str(exc))
    mode = "byte for byte" if tolerance is None else f"atol {tolerance.atol:g}, rtol {tolerance.rtol:g}"
    table = Table(title=f"verify {mode}: seed {seed}, {trials} trial(s)")
    for column in ("pass", "rows", "replays", "buffers", "result"):
        table.add_column(column, justify="left" if column in ("pass", "result") else "right")
    for check in checks:
        result = "identical" if not check.differences else f"[red]{len(check.differences)} differ[/]"
        if not check.differences and tolerance is not None:
            result = "within tolerance"
        table.add_row(check.pass_name, str(check.rows), str(check.replays), str(check.buffers), result)
    console.print(table)
    differences = [line for check in checks for line in check.differences]
    for line in differences:
        click.echo(f"differs: {line}")
    if differences:
        fail(f"{len(differences)} buffer(s) differ between {a} and {b}")
