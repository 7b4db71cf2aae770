"""`b12x train`: train the shipped model's tokenizer, target and drafter into a checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from b12x_toolchain.exporter.cli.common import console, fail


@click.command()
@click.option("--out", "out_dir", default="out/train", show_default=True, type=click.Path(file_okay=False),
              help="Directory for tokenizer/, recipe.yaml and checkpoint/ (checkpoint/ must not exist or be empty).")
@click.option("--recipe", default="dsv41-mini", show_default=True, help="Bundled recipe name or YAML path of the model.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seeds the initial weights, crops and anchors.")
@click.option("--target-steps", default=None, type=click.IntRange(min=1), help="Target optimiser steps.")
@click.option("--drafter-steps", default=None, type=click.IntRange(min=1), help="Drafter optimiser steps.")
@click.option("--target-from", type=click.Path(exists=True, dir_okay=False),
              help="An earlier run's target.safetensors: keep that target and train only the drafter.")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1), help="torch intra-op threads.")
def train(out_dir, recipe, seed, target_steps, drafter_steps, target_from, threads):
    """Train the tokenizer, the target and its DSpark drafter on the Python standard library's
    sources and write a release-layout checkpoint (checkpoints/dsv41-mini was made this way)."""
    import dataclasses

    import torch

    from b12x_toolchain.exporter.recipe.loader import RecipeError
    from b12x_toolchain.exporter.train.pipeline import TrainingOptions
    from b12x_toolchain.exporter.train.pipeline import train as run_training

    torch.set_num_threads(threads)
    options = TrainingOptions(recipe=recipe, seed=seed, target_from=target_from)
    changes = {k: v for k, v in (("target_steps", target_steps), ("drafter_steps", drafter_steps)) if v is not None}
    options = dataclasses.replace(options, **changes)
    checkpoint = Path(out_dir) / "checkpoint"
    if checkpoint.exists() and any(checkpoint.iterdir()):
        fail(f"{checkpoint}: not empty; give --out a new directory")
    try:
        summary = run_training(Path(out_dir), options, log=lambda line: console.print(line, highlight=False))
    except (RecipeError, ValueError) as exc:
        fail(str(exc))
    console.print(f"held-out perplexity (fp32) {summary['target']['heldout_perplexity_fp32']:.3f}; "
                  f"drafter accepted per block {summary['drafter']['accepted_per_block']:.2f}; "
                  f"{summary['seconds']:.0f} s", highlight=False)
