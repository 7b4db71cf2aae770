"""`b12x train`: the tokenizer, the target, the drafter, then the release-layout checkpoint.

Seeded end to end (the corpus order, crops, anchors and initial weights all come from
`seed`), so the same corpus and options give the same checkpoint on the same machine.
The lightning indexer, whose top-k choice carries no gradient, is trained by distilling
the main attention's distribution over the compressed entries into its scores (KL, as
DeepSeek's dense warm-up does; training_ops.IndexerDistillation), added to the next-token
loss with weight INDEXER_WEIGHT.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import safetensors.torch
import torch
import yaml

from b12x_toolchain.exporter.model.engram import TOKEN_MAP
from b12x_toolchain.exporter.model.engram_token_map import compressed_token_map, token_map_keys
from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_from_dict
from b12x_toolchain.exporter.train import drafter, generation, language_model
from b12x_toolchain.exporter.train.checkpoint_writer import stored_weights, write_release_checkpoint
from b12x_toolchain.exporter.train.corpus import fingerprint, load_corpus
from b12x_toolchain.exporter.train.tokenizer import EOS_TOKEN, save_tokenizer, train_tokenizer
from b12x_toolchain.exporter.train.training_ops import IndexerDistillation

INDEXER_WEIGHT = 0.1


@dataclass(frozen=True)
class TrainingOptions:
    recipe: str = "dsv41-mini"
    seed: int = 0
    target_steps: int = 800
    target_lr: float = 3e-3
    drafter_steps: int = 1200
    drafter_lr: float = 2e-3
    rows: int = 16  # sequences a target step; a drafter step takes rows // 2 sequences, 16 anchors each
    length: int = 128  # tokens a sequence: the window, so every position trains with its whole window
    drafter_sequences: int = 256  # training windows the drafter's anchors come from
    target_from: str | None = None  # a target.safetensors of an earlier run: train only the drafter
    drafter_generated: int = 512  # and sequences the target writes itself: a window's first half, then its greedy tokens
    heldout_windows: int = 128  # held-out windows the report's perplexity averages over


def shipping_recipe(recipe, tokenizer) -> tuple[object, dict]:
    """`recipe` with its Engram compressed vocabulary set to the tokenizer's distinct keys."""
    data = copy.deepcopy(recipe.normalized())
    engram = data["model"].get("engram")
    if engram is not None:
        engram["compressed_vocab_size"] = len(set(token_map_keys(tokenizer)))
    return recipe_from_dict(data), data


def float_recipe(data: dict):
    """The same model with every weight fp32: what trains (the shipping formats come after)."""
    return recipe_from_dict({key: value for key, value in data.items() if key != "weights"})


def train(out: Path, options: TrainingOptions = TrainingOptions(), log: Callable[[str], None] = print) -> dict:
    """Train into out/ (tokenizer/, checkpoint/); returns the summary written as training.json."""
    out = Path(out)
    started = time.perf_counter()
    torch.manual_seed(options.seed)
    corpus = load_corpus()
    log(f"corpus: Python {corpus.python_version} standard library, {len(corpus.train)} training files, "
        f"{len(corpus.heldout)} held out")
    named = load_recipe(options.recipe)
    tokenizer = train_tokenizer(corpus.train, named.model.vocab_size, seed=options.seed)
    save_tokenizer(tokenizer, out / "tokenizer")
    recipe, data = shipping_recipe(named, tokenizer)
    (out / "recipe.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    d, d_train = Dims.from_recipe(recipe), Dims.from_recipe(float_recipe(data))
    eos = tokenizer.token_to_id(EOS_TOKEN)
    train_stream = language_model.token_stream(tokenizer, corpus.train, eos)
    heldout_stream = language_model.token_stream(tokenizer, corpus.heldout, eos)
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens; {len(train_stream):,} training tokens, "
        f"{len(heldout_stream):,} held out")

    weights = init_weights(d_train, options.seed)
    if d.engram is not None:
        e = d.engram
        weights[TOKEN_MAP] = compressed_token_map(out / "tokenizer" / "tokenizer.json", d.vocab, e.compressed_vocab,
                                                  pad_id=e.pad_id)
    module = PASSES["prefill"](d_train)
    generator = torch.Generator().manual_seed(options.seed)
    target_losses = _train_target(out, options, module, weights, train_stream, generator, log)
    heldout = heldout_stream[: options.heldout_windows * options.length]
    ppl = language_model.perplexity(module, weights, heldout, options.length)
    log(f"target: held-out perplexity {ppl:.3f} (fp32 weights)")
    drafter_losses, accepted = _train_drafter(options, data, d, module, weights, train_stream, generator, log)

    summary = {
        "options": asdict(options), "corpus": {"python": corpus.python_version, "fingerprint": fingerprint(corpus),
                                               "train_files": len(corpus.train), "heldout_files": len(corpus.heldout)},
        "target": {"final_loss": _tail_mean(target_losses), "heldout_perplexity_fp32": ppl},
        "drafter": {"final_loss": _tail_mean(drafter_losses), "accepted_per_block": _tail_mean(accepted)},
        "seconds": round(time.perf_counter() - started, 1), "torch": torch.__version__,
    }
    write_release_checkpoint(out / "checkpoint", recipe, d, weights, out / "tokenizer", summary)
    log(f"wrote {out / 'checkpoint'} in {summary['seconds']:.0f} s")
    return summary


def _train_target(out: Path, options: TrainingOptions, module, weights: dict, train_stream, generator,
                  log: Callable[[str], None]) -> list[float]:
    """Train every weight but the drafter's (next-token loss and the indexer's distillation), saved
    as out/target.safetensors, or take them from options.target_from; the losses, a step each."""
    target_names = [n for n in weights if n not in drafter.drafter_weight_names(weights)]
    params = language_model.trainable(weights, target_names)

    def target_step(step):
        tokens = language_model.random_crops(train_stream, options.rows, options.length, generator)
        distillation = IndexerDistillation()
        logits, _ = language_model.forward_sequences(module, weights, tokens, distillation)
        indexer = torch.stack(distillation.losses).mean() if distillation.losses else 0.0
        return language_model.next_token_loss(logits, tokens) + INDEXER_WEIGHT * indexer

    if options.target_from is None:
        schedule = language_model.Schedule(options.target_steps, options.target_lr,
                                           warmup=max(1, options.target_steps // 20))
        target_losses = language_model.optimise(params, schedule, target_step,
                                                _every(log, "target", options.target_steps))
        safetensors.torch.save_file({n: t.detach().contiguous() for n, t in weights.items()},
                                    str(out / "target.safetensors"))
    else:  # the float weights as the earlier run left them after its target phase
        weights.update(safetensors.torch.load_file(options.target_from))
        target_losses = []
    for tensor in params:
        tensor.requires_grad_(False)
    return target_losses


def _train_drafter(options: TrainingOptions, data: dict, d: Dims, module, weights: dict, train_stream, generator,
                   log: Callable[[str], None]) -> tuple[list[float], list[float]]:
    """Train the drafter's weights on training windows and on sequences the trained target continues
    greedily; the losses and the mean accepted tokens a block, a step each."""
    crops = language_model.random_crops(train_stream, options.drafter_sequences, options.length, generator)
    if options.drafter_generated:
        half = options.length // 2
        prompts = language_model.random_crops(train_stream, options.drafter_generated, half, generator)
        written = generation.greedy_continuations(data, stored_weights(d, weights), prompts, options.length - half)
        log(f"drafter: {len(written)} sequences the target continued greedily")
        crops = torch.cat([crops, written])
    draft_data = drafter.draft_data(module, weights, crops)
    draft_params = language_model.trainable(weights, drafter.drafter_weight_names(weights))
    accepted = []

    def drafter_step(step):
        seqs, anchors = drafter.sample_anchors(draft_data, options.rows // 2, 16, d.draft_width, generator)
        loss, mean_accepted = drafter.draft_loss(module, weights, draft_data, seqs, anchors)
        accepted.append(float(mean_accepted))
        return loss

    schedule = language_model.Schedule(options.drafter_steps, options.drafter_lr,
                                       warmup=max(1, options.drafter_steps // 20))
    drafter_losses = language_model.optimise(draft_params, schedule, drafter_step,
                                             _every(log, "drafter", options.drafter_steps, accepted))
    for tensor in draft_params:
        tensor.requires_grad_(False)
    return drafter_losses, accepted


def _tail_mean(values: list[float], count: int = 20) -> float:
    tail = values[-count:]
    return round(sum(tail) / max(1, len(tail)), 4)


def _every(log, label: str, steps: int, extra: list | None = None):
    started = time.perf_counter()

    def report(step, loss):
        if step % 25 == 0 or step == steps - 1:
            more = f"  accepted/block {extra[-1]:.2f}" if extra else ""
            log(f"{label} step {step + 1}/{steps}: loss {loss:.3f}{more}  ({time.perf_counter() - started:.0f} s)")
    return report
