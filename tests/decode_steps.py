"""Drive a package the way a server does, teacher-forced: every position's logits.

Prefill in chunks, then verify steps of width 8 over the true next tokens whose first 1,
7 or 8 rows are committed, two requests of different lengths sharing each replay.
"""

from __future__ import annotations

import torch

COMMIT_WIDTHS = (1, 7, 8)
FP32_CACHES = {"cache.window_format": "fp32", "cache.compressed_format": "fp32", "cache.index_format": "fp32"}
# A recipe change that drops the `weights` section: every weight fp32, the digest of the recipe without it.
FP32_WEIGHTS = {"weights": None}
# dsv4-tiny cut to two target layers (CSA with hash routing, then HCA) plus the MTP stage
# (window-only): every V4 layer kind, weight kind and release format in about half the
# export time of the four-layer recipe. 64-token chunks: an 80-token prompt takes two.
SMALL_V4 = {
    "model.num_layers": 2,
    "model.compress_ratios": [4, 16, 0],
    "passes.prefill.chunk": 64,
    "rewrites.0.expect_matches": {"prefill": 0, "verify": 2, "draft": 0, "commit": 0, "decode": 0},
}


def exported(recipe, weights, tmp_path_factory, changes=None, name=None):
    """The recipe (or its variant with `changes`) exported with `weights`, loaded."""
    from b12x_toolchain.exporter.pipeline.export import export_package
    from b12x_toolchain.exporter.recipe.variants import recipe_variant
    from b12x_toolchain.runtime import load

    if changes:
        recipe = recipe_variant(recipe, changes, name=name)
    return load(export_package(recipe, tmp_path_factory.mktemp(recipe.name), weights=weights).path)


def single_forward(recipe, weights, tokens, module_hook=None):
    """Every position in one prefill call of the eager module: nothing is read back from a cache.
    `module_hook(module)` may replace a part of the module first (a reference to compare with)."""
    import paging
    from b12x_toolchain.exporter.model.pass_modules import PASSES
    from b12x_toolchain.exporter.recipe.dims import Dims
    from b12x_toolchain.exporter.recipe.variants import recipe_variant

    n = len(tokens)
    variant = recipe_variant(recipe, {**FP32_CACHES, "cache.history": n, "passes.prefill.chunk": n, "rewrites": []},
                             name="single-forward")
    module = PASSES["prefill"](Dims.from_recipe(variant))
    if module_hook is not None:
        module_hook(module)
    inputs, _ = module.convention()
    caches = {s.name: torch.zeros(s.resolve(paging.symbols(inputs, 2)), dtype=s.torch_dtype) for s in module.caches()}
    one = torch.tensor([0], dtype=torch.int32)
    with torch.no_grad():
        out = module(weights, caches, {}, {"tokens": torch.tensor([tokens], dtype=torch.int32), "row_ids": one,
                                           "positions": one * 0, "lengths": one * n,
                                           **paging.block_tables(inputs, one)})
    return out["logits"][0]


def prefill(session, slot, tokens):
    chunk = session.package.passes["prefill"].width
    rows = []
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        out = session.replay("prefill", token_ids=[piece + [0] * (chunk - len(piece))], slot_ids=[slot],
                             positions=[start], new_tokens=[len(piece)])
        rows.append(out["logits"][0, : len(piece)].clone())
    return torch.cat(rows)


def incremental(pkg, sequences, prompt_lengths):
    """Logits of every position of each sequence, [positions covered, vocab] per sequence."""
    session = pkg.session(slots=len(sequences), max_rows=len(sequences))
    width = pkg.passes["verify"].width
    slots = list(range(len(sequences)))
    got = [{} for _ in sequences]
    lengths = list(prompt_lengths)
    for slot, (seq, n) in enumerate(zip(sequences, prompt_lengths)):
        session.reset_slot(slot)
        for j, row in enumerate(prefill(session, slot, seq[:n])):
            got[slot][j] = row
    step = 0
    while max(lengths) + width <= min(len(s) for s in sequences):
        tokens = [seq[p : p + width] for seq, p in zip(sequences, lengths)]
        out = session.replay("verify", token_ids=tokens, slot_ids=slots, positions=lengths)
        for slot, p in enumerate(lengths):
            for j in range(width):
                got[slot].setdefault(p + j, out["logits"][slot, j].clone())
        accept = [COMMIT_WIDTHS[(step + slot) % len(COMMIT_WIDTHS)] for slot in slots]
        session.replay("commit", slot_ids=slots, positions=lengths, accepted_tokens=accept)
        lengths = [p + a for p, a in zip(lengths, accept)]
        step += 1
    return [torch.stack([g[p] for p in sorted(g)]) for g in got]


def relative_rms(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()
