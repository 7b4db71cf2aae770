"""Replay cost of the tiny recipe's verify and draft passes on CPU.

Three comparisons, each per pass and rows count:

* fused vs unfused: the same recipe exported with and without the rewrite pipeline,
  both replayed through `Session.replay`; ratio = fused / unfused.
* ours vs eager: the exported graph through `Session.replay` against calling the eager
  pass module directly on the very same weights, caches, staging and static inputs;
  ratio = ours / eager. "Ours" includes what a caller of the runtime pays per replay
  (input validation, copies into the bucket's static inputs and outputs); eager does not.
* replay overhead: `Session.replay` against calling the bucket's graph alone on its fixed
  arguments (torch dispatching the graph's nodes and nothing else); ratio = replay / graph,
  what the runtime adds per replay on top of torch's own dispatch (validation, the copies
  into the static inputs, outputs by kind).
* graph nodes: call_function nodes per pass graph, from the fused package's manifest;
  ratio = fused / unfused.

Rows 3 has no bucket of its own: it pads to the 4-row bucket, so it costs what rows 4 costs
plus the padding; it is measured because that padding is what a server pays for odd batches.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.runtime import load, read_manifest
from b12x_toolchain.runtime.serving.speculative import Decoder
from benchmarks.registry import Settings, benchmark, compare_counts, compare_timed

RECIPE = "dsv41-tiny"
TIMED_PASSES = ("verify", "draft")
ROWS = (1, 3)
SLOTS = max(ROWS)  # every row of a replay needs a slot of its own
PROMPT_TOKENS = 150  # three prefill chunks, and past the 128-token window, so the window wraps
SEED = 0


def prefilled_session(package):
    """A CPU session whose slots all hold the same random prompt for a given package.

    Verify and draft only write staging, so they can be replayed again and again at the
    committed length this leaves behind.
    """
    session = package.session(device="cpu", slots=SLOTS)
    gen = torch.Generator().manual_seed(SEED)
    decoder = Decoder(session)
    for slot in range(SLOTS):
        decoder.prefill(slot, torch.randint(0, package.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist())
    return session


def replay_inputs(session, pass_name: str, rows: int) -> dict[str, torch.Tensor]:
    """Tokens for the first `rows` slots at their committed positions, as int32 tensors."""
    width = session.package.passes[pass_name].width
    gen = torch.Generator().manual_seed(SEED + rows)  # same tokens for every session
    return {
        "token_ids": torch.randint(0, session.package.vocab_size, (rows, width), dtype=torch.int32, generator=gen),
        "slot_ids": torch.arange(rows, dtype=torch.int32),
        "positions": torch.tensor(session.seq_lens[:rows], dtype=torch.int32),
    }


def eager_call(session, module, pass_name: str, rows: int):
    """Call the eager module on the session's own buffers for the bucket `rows` pads to.

    The bucket's static inputs are whatever the last `session.replay` of this bucket copied
    in (the real rows, then padding rows pointing at the scratch slot), so a replay must
    run first; the benchmark replays before every comparison anyway.
    """
    info = session.package.passes[pass_name]
    bucket = session.bucket_for(pass_name, rows)
    weights = session.weights_for(info)
    caches = {s.name: session.caches[s.name] for s in info.inputs if s.role == "cache"}
    return lambda: module(weights, caches, bucket.staging, bucket.inputs)


def check_same(what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    # Timing two paths against each other only means something if they do the same work.
    try:
        torch.testing.assert_close(got, expected)
    except AssertionError as exc:
        raise RuntimeError(f"{what}: outputs differ, so their timings are not comparable\n{exc}") from None


def node_counts(fused_manifest, unfused_manifest) -> list:
    """Graph sizes before and after the rewrite pipeline, per pass.

    An unfused package runs an empty pipeline, so its manifest records no node counts;
    the fused package's first rewrite saw the very same captured graph, so its
    `nodes_before` is the unfused size and the last rewrite's `nodes_after` the fused one.
    """
    if unfused_manifest.rewrites.pipeline:
        raise RuntimeError(f"the unfused package ran rewrites {list(unfused_manifest.rewrites.pipeline)}")
    pipeline = list(fused_manifest.rewrites.pipeline)
    out = []
    for pass_name, results in fused_manifest.rewrites.results.items():
        records = [results[name] for name in pipeline]
        out.append(compare_counts("replay.graph_nodes", pass_name, records[0].nodes_before,
                                  records[-1].nodes_after, "nodes", "unfused", "fused",
                                  {"pass": pass_name, "rewrites": pipeline}))
    return out


def case_name(pass_name: str, rows: int, bucket: int) -> str:
    return f"{pass_name} rows={rows}" + (f" (bucket {bucket})" if bucket != rows else "")


def packages(recipe, settings: Settings):
    """The fused and unfused packages of `recipe`: the ones `--packages` names, else fresh exports."""
    if settings.packages is not None:
        for path, fused in zip(settings.packages, (True, False)):
            manifest = read_manifest(path)  # checked before anything is loaded
            if manifest.recipe_sha256 != recipe.sha256() or bool(manifest.rewrites.pipeline) != fused:
                raise SystemExit(f"--packages: {path} is not the {'fused' if fused else 'unfused'} "
                                 f"export of the {RECIPE} recipe")
        return [load(path) for path in settings.packages]
    with tempfile.TemporaryDirectory(prefix="b12x-bench-") as tmp:
        # load() reads every file into memory, so the packages outlive their directory.
        return (load(export_package(recipe, Path(tmp) / "fused", fuse=True).path),
                load(export_package(recipe, Path(tmp) / "unfused", fuse=False).path))


@benchmark("replay")
def replay_benchmark(settings: Settings) -> list:
    recipe = load_recipe(RECIPE)
    dims = Dims.from_recipe(recipe)
    fused_pkg, unfused_pkg = packages(recipe, settings)

    results = node_counts(fused_pkg.manifest, unfused_pkg.manifest)
    fused, unfused = prefilled_session(fused_pkg), prefilled_session(unfused_pkg)
    fused_vs_unfused, ours_vs_eager, overhead = [], [], []
    for pass_name in TIMED_PASSES:
        module = PASSES[pass_name](dims)
        for rows in ROWS:
            inputs = replay_inputs(fused, pass_name, rows)
            bucket = fused.bucket_for(pass_name, rows).rows
            case = case_name(pass_name, rows, bucket)
            params = {"pass": pass_name, "rows": rows, "bucket": bucket}

            ours = lambda: fused.replay(pass_name, **inputs)
            reference = lambda: unfused.replay(pass_name, **inputs)
            eager = eager_call(fused, module, pass_name, rows)
            logits = ours()["logits"].clone()  # also fills the bucket's static inputs for `eager`
            check_same(f"{case}: fused vs unfused", logits, reference()["logits"])
            check_same(f"{case}: exported vs eager", logits, eager()["logits"][:rows])

            fused_vs_unfused.append(compare_timed("replay.fused_vs_unfused", case, reference, ours, settings,
                                                  "unfused", "fused", params))
            ours_vs_eager.append(compare_timed("replay.ours_vs_eager", case, eager, ours, settings,
                                               "eager", "ours", params))
            bucket = fused.bucket_for(pass_name, rows)
            overhead.append(compare_timed("replay.overhead", case, lambda: bucket.graph(*bucket.args), ours,
                                          settings, "graph alone", "Session.replay", params))
    return fused_vs_unfused + ours_vs_eager + overhead + results
