"""`b12x export`: capture, rewrite and write a package, or check that a package re-exports."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click
from rich.table import Table

from b12x_toolchain.exporter.cli.common import console, fail


class Progress:
    """One line per pass as it is captured and rewritten: a full-size pass takes seconds."""

    def __init__(self, table: Table | None):
        self.table, self.started = table, {}

    def on_capture(self, name):
        self.started[name] = time.perf_counter()
        console.print(f"capturing [bold]{name}[/] …", highlight=False)

    def on_pass(self, name, records):
        seconds = time.perf_counter() - self.started[name]
        nodes = f", {records[0].nodes_before} → {records[-1].nodes_after} nodes" if records else ""
        console.print(f"captured [bold]{name}[/] in {seconds:.1f} s{nodes}", highlight=False)
        if self.table is None:
            return
        if not records:
            self.table.add_row(name, "-", "-", "-", "-")
        for r in records:
            self.table.add_row(name, r.name, str(r.matches), str(r.nodes_before), str(r.nodes_after))


def _checksums(index, recipe):
    from b12x_toolchain.exporter.model.weights import weight_shapes
    from b12x_toolchain.exporter.pipeline.checkpoint_index import index_checksums
    from b12x_toolchain.exporter.recipe.dims import Dims

    return index_checksums(index, weight_shapes(Dims.from_recipe(recipe)))


def _check(check_path, recipe, weights_index, dump_passes, jobs):
    from b12x_toolchain.exporter.pipeline.export import ExportError
    from b12x_toolchain.exporter.pipeline.reexport import ReexportError, check_package, settings_from_manifest
    from b12x_toolchain.runtime import PackageError
    from b12x_toolchain.runtime.package.reader import read_manifest

    try:
        manifest = read_manifest(check_path)
        settings = settings_from_manifest(manifest, recipe)
        if weights_index is not None:
            settings.checksums = _checksums(weights_index, settings.recipe)
    except (PackageError, ReexportError) as exc:
        fail(str(exc))
    progress = Progress(None)
    try:
        differing = check_package(check_path, settings, dump_dir=dump_passes, jobs=jobs,
                                  on_capture=progress.on_capture, on_pass=progress.on_pass)
    except (ExportError, ValueError) as exc:
        fail(f"re-export of {check_path} failed: {exc}")
    if differing:
        for name in differing:
            click.echo(f"differs: {name}", err=True)
        fail(f"re-export of {check_path} is not byte-identical: {len(differing)} file(s) differ")
    click.echo(f"{check_path}: re-export is byte-identical")  # one unwrapped line for CI logs


def _checkpoint_weights(directory, recipe):
    """(weights, source, tokenizer or None) from a Hugging Face checkpoint; a CheckpointError
    names the directory."""
    from b12x_toolchain.exporter.hf.checkpoint import checkpoint_source, load_hf_checkpoint
    from b12x_toolchain.exporter.hf.tokenizer_files import checkpoint_tokenizer
    from b12x_toolchain.exporter.recipe.dims import Dims
    from b12x_toolchain.runtime.package.checkpoint import CheckpointError

    d = Dims.from_recipe(recipe)
    try:
        tokenizer = checkpoint_tokenizer(directory, d.vocab)  # before the weights: a bad one fails in a moment
        return load_hf_checkpoint(directory, d), checkpoint_source(directory), tokenizer
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {directory}: {exc}") from None


def _load(recipe_source):
    """The recipe `--recipe` names; a missing NAME.yaml that is a bundled name loads that recipe, saying so."""
    from b12x_toolchain.exporter.recipe.loader import bundled_fallback, load_recipe

    bundled = bundled_fallback(recipe_source)
    if bundled is not None:
        click.echo(f"{recipe_source}: no such file; using the bundled recipe {bundled}", err=True)
    return load_recipe(bundled or recipe_source)


def _size(count: int) -> str:
    """A byte count as a person reads it: 1000 bytes, 9.8 MiB, 1.2 TiB."""
    value = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{count} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _weight_budget(max_weight_bytes):
    """(bytes, what they are) random weights may take; (None, "") when memory is unknown."""
    if max_weight_bytes is not None:
        return max_weight_bytes, "--max-weight-bytes"
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None, ""
    # A quarter: export holds the tensors and their serialized safetensors copy at once, beside capture.
    return memory // 4, f"a quarter of the {_size(memory)} of physical memory"


def _structural_for_size(recipe, weights_mode, max_weight_bytes) -> bool:
    """True when random weights would not fit the budget; fails when they were asked for explicitly.

    Runs before anything is allocated: a full-size recipe's random weights would otherwise
    die in the allocator or take all memory.
    """
    from b12x_toolchain.exporter.model.weights import random_weight_bytes
    from b12x_toolchain.exporter.recipe.dims import Dims

    size = random_weight_bytes(Dims.from_recipe(recipe))
    budget, what = _weight_budget(max_weight_bytes)
    if budget is None or size <= budget:
        return False
    over = f"{recipe.name}: random weights take {_size(size)}, over the budget of {_size(budget)} ({what})"
    if weights_mode == "init":
        fail(f"{over}; use --weights none (structural export), --checkpoint DIR (real weights) "
             f"or a larger --max-weight-bytes")
    click.echo(f"{over}; exporting structurally (weights external); --weights init with a larger "
               f"--max-weight-bytes forces random weights, --checkpoint DIR takes real ones", err=True)
    return True


@click.command()
@click.option("--recipe", "recipe_source", help="Bundled recipe name (dsv41-tiny) or a YAML path.")
@click.option("--out", "out_dir", default="out", show_default=True, type=click.Path(file_okay=False),
              help="Directory the NAME.b12x package is written into.")
@click.option("--no-fuse", is_flag=True, help="Skip the rewrite pipeline (reference package).")
@click.option("--weights", "weights_mode", type=click.Choice(["init", "none"]),
              help="init: random weights from the recipe's init_seed, stored in the package (the default when "
                   "they fit --max-weight-bytes, else a structural export). none: structural export, no weights "
                   "stored; runtime.load(pkg, weights=DIR) binds them.")
@click.option("--max-weight-bytes", type=click.IntRange(min=0),
              help="Most bytes random weights may take; default a quarter of physical memory. Larger ones export "
                   "structurally, or fail with --weights init, before anything is allocated.")
@click.option("--weights-index", type=click.Path(exists=True),
              help="With --weights none: a checkpoint directory or its model.safetensors.index.json. Every "
                   "weight must be in its weight_map; its sha256 map is recorded for load to check.")
@click.option("--checkpoint", "checkpoint_dir", type=click.Path(),
              help="Take the weights from a Hugging Face DeepSeek V4 checkpoint directory (config.json and "
                   "safetensors shards); it must match the recipe exactly. deepseek_v4 recipes only. Its "
                   "tokenizer.json and tokenizer_config.json, when present, go into the package too.")
@click.option("--check", "check_path", type=click.Path(exists=True),
              help="Re-export PKG (a package directory or its manifest.json) from what it records into a "
                   "temporary directory; fail, naming the differing files, unless byte-identical. "
                   "--recipe replaces the recorded recipe.")
@click.option("--dump-passes", type=click.Path(file_okay=False),
              help="Write every pass's graph as captured and after each rewrite to DIR/PASS/NN-STAGE.txt.")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(min=1),
              help="Passes exported at once, each in a worker process; the bytes are the same for any N.")
def export(recipe_source, out_dir, no_fuse, weights_mode, max_weight_bytes, weights_index, checkpoint_dir, check_path,
           dump_passes, jobs):
    """Capture every pass of a recipe, rewrite it and write a package."""
    from b12x_toolchain.exporter.pipeline.export import ExportError, export_package
    from b12x_toolchain.exporter.recipe.loader import RecipeError
    from b12x_toolchain.runtime.package.checkpoint import CheckpointError

    if weights_index is not None and weights_mode != "none" and check_path is None:
        fail("--weights-index needs --weights none")
    if check_path is not None and (no_fuse or weights_mode is not None):
        fail("--check re-exports with the settings PKG records; drop --no-fuse and --weights")
    if recipe_source is None and check_path is None:
        fail("--recipe is required (or --check PKG)")
    if checkpoint_dir is not None and (weights_mode is not None or weights_index is not None or check_path is not None):
        fail("--checkpoint supplies the weights; drop --weights, --weights-index and --check")
    try:
        recipe = _load(recipe_source) if recipe_source is not None else None
        if check_path is not None:
            return _check(check_path, recipe, weights_index, dump_passes, jobs)
        structural = weights_mode == "none" or (
            checkpoint_dir is None and _structural_for_size(recipe, weights_mode, max_weight_bytes))
        checksums = _checksums(weights_index, recipe) if weights_index is not None else None
        weights, source, tokenizer = _checkpoint_weights(checkpoint_dir, recipe) if checkpoint_dir is not None \
            else (None, None, None)
    except (RecipeError, CheckpointError) as exc:
        fail(str(exc))
    table = Table(title=f"{recipe.name}: passes")
    for column in ("pass", "rewrite", "matches", "nodes before", "nodes after"):
        table.add_column(column, justify="left" if column in ("pass", "rewrite") else "right")
    progress = Progress(table)
    try:
        result = export_package(recipe, Path(out_dir), fuse=not no_fuse, on_pass=progress.on_pass,
                                structural=structural, checksums=checksums, dump_dir=dump_passes,
                                on_capture=progress.on_capture, jobs=jobs, weights=weights,
                                weights_source=source, tokenizer=tokenizer)
    except (ExportError, ValueError) as exc:
        fail(str(exc))
    console.print(table)
    weights = "external weights" if structural else "weights stored"
    text = "  tokenizer" if tokenizer is not None else ""
    console.print(f"wrote [bold]{result.path}[/]  abi {result.abi_fingerprint[:16]}  {weights}{text}", highlight=False)
