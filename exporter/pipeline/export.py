"""recipe -> captured passes -> rewrite pipeline -> package, the exporter's one entry point."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

import b12x_toolchain
from b12x_toolchain.exporter.errors import ExportError  # noqa: F401  (re-exported)
from b12x_toolchain.exporter.hf.tokenizer_files import PackageTokenizer
from b12x_toolchain.exporter.model.parallel import engram_tables
from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.model.weight_roles import role_of
from b12x_toolchain.exporter.model.weights import init_weights, weight_formats
from b12x_toolchain.exporter.pipeline.package_writer import weights_bytes, write_package
from b12x_toolchain.exporter.pipeline.pass_export import PassJob, PassOutput, pass_label, run_jobs
from b12x_toolchain.exporter.pipeline.rank_files import TOKENIZER_FORMAT, RankFiles
from b12x_toolchain.exporter.pipeline.structural import external_weights
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.formats.dsv41 import FLASHINFER_PIN  # the byte reference's version; the tests install it
from b12x_toolchain.runtime.ops.opset import OPSET_VERSION
from b12x_toolchain.runtime.package.cache_formats import cache_formats_entry
from b12x_toolchain.runtime.package.contract import BufferInfo, described
from b12x_toolchain.runtime.package.conventions import PassEntry
from b12x_toolchain.runtime.package.manifest import (
    Manifest,
    ModelFacts,
    Rewrites,
    Weights,
    abi_fingerprint,
)
from b12x_toolchain.runtime.package.manifest import RewriteResult as ManifestRewriteResult  # a result as recorded
from b12x_toolchain.runtime.package.torch_versions import RANGE, release, running_torch, supported
from b12x_toolchain.runtime.prefix.snapshot import capabilities as snapshot_capabilities
from b12x_toolchain.runtime.rewrite import RewriteResult


@dataclass
class ExportResult:
    path: Path
    abi_fingerprint: str
    records: dict[str, list[RewriteResult]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # per pass: capture, rewrites, serialisation
    cpu_seconds: dict[str, float] = field(default_factory=dict)  # per pass: the same in CPU time
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)  # per pass: of the process that exported it


# The oldest torch that exports: torch 2.11's export specialises the symbolic `rows` dimension
# (a graph fixed to one bucket), and 2.13 is the oldest the exporter is checked on. The runtime
# also runs on 2.11 and 2.12, but loads no package exported with a torch outside its range
# (runtime/package/torch_versions.py), so export refuses those too.
EXPORT_TORCH = (2, 13)


def check_export_torch() -> None:
    """Refuse to export on a torch that exports wrongly, or whose packages the runtime would refuse."""
    running = running_torch()
    if release(running) < EXPORT_TORCH:
        raise ExportError(f"export needs torch >= {EXPORT_TORCH[0]}.{EXPORT_TORCH[1]}; this is torch {running}")
    if not supported(running):
        raise ExportError(f"export needs a torch whose packages the runtime loads ({RANGE}); this is torch {running}")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def tool_versions() -> dict:
    return {
        "b12x": b12x_toolchain.__version__,
        "torch": torch.__version__,
        "safetensors": _version("safetensors"),
        "flashinfer_pin": FLASHINFER_PIN,
    }


def check_matches(recipe, pass_name: str, records: list[RewriteResult]) -> None:
    found = {r.name: r.matches for r in records}
    for rewrite in recipe.rewrites:
        expected = rewrite.expect_matches[pass_name]
        if found[rewrite.name] != expected:
            raise ExportError(
                f"rewrite {rewrite.name} found {found[rewrite.name]} matches in the {pass_name} graph; "
                f"the recipe expects {expected} (rewrites[].expect_matches.{pass_name})"
            )


def pass_entry(module, rows_buckets, inputs: list, outputs: list, graph: str | None = None) -> PassEntry:
    """A pass's manifest entry: its calling convention and what a server drives it by (`graph`:
    the file of its graph, of rank 0 in a parallel package)."""
    return PassEntry(module.name, graph or f"graphs/{module.name}.pt2", tuple(rows_buckets), module.width(),
                     module.advances, module.reads_staging_of, tuple(inputs), tuple(outputs))


def buffer_table(conventions: list[list]) -> dict[str, BufferInfo]:
    """What every cache and staging buffer of the passes' inputs is, by name; passes sharing a
    buffer must agree on it."""
    table = {}
    for inputs in conventions:
        for spec in inputs:
            if described(spec.role):
                if table.setdefault(spec.name, spec.info) != spec.info:
                    raise ExportError(f"buffer {spec.name}: passes describe it differently "
                                      f"({table[spec.name].to_json()} and {spec.info.to_json()})")
    return {name: table[name] for name in sorted(table)}


def with_tokenizer(manifest: Manifest, files: dict[str, bytes], tokenizer: PackageTokenizer | None
                   ) -> tuple[Manifest, dict[str, bytes]]:
    """The manifest and files of a package carrying `tokenizer` (its files, its section, format
    4.4); without one, both as they were, so such a package's bytes do not change."""
    if tokenizer is None:
        return manifest, files
    return (dataclasses.replace(manifest, format_version=TOKENIZER_FORMAT, tokenizer=tokenizer.facts),
            {**files, **tokenizer.files})


def check_computable_formats(d: Dims) -> None:
    """Block-scaled routed experts are computed by the op set's FP4 expert linear; no op takes
    FP8 experts yet, so a recipe giving them fp8_e4m3 is refused by role."""
    fp8_experts = sorted({f.describe() for n, f in weight_formats(d).items()
                          if role_of(n) == "routed_experts" and f.kind == "fp8_e4m3"})
    if fp8_experts:
        raise ExportError(f"weights.routed_experts: {fp8_experts[0]} experts have no expert op yet; store them "
                          "fp4_e2m1, bf16 or fp32")


def weights_to_export(recipe, d: Dims, weights: dict | None, structural: bool,
                      weights_source: str | None) -> tuple[dict | None, str]:
    """The weights to export (None for a structural export) and where they came from."""
    if structural and weights is not None:
        raise ExportError("a structural export takes no weights")
    if weights_source is not None and weights is None:
        raise ExportError("weights_source describes supplied weights; none were given")
    source = (weights_source or "supplied by the caller") if weights is not None else \
        f"random init, seed {recipe.model.init_seed}"
    if weights is None and not structural:
        weights = init_weights(d, recipe.model.init_seed)
    return weights, source


def run_pass_jobs(recipe, ranks: RankFiles, shards: dict, rewrite_names: list[str], dump_dir: Path | None,
                  jobs: int, on_capture: Callable[[str], None] | None,
                  on_pass: Callable[[str, list[RewriteResult]], None] | None) -> dict[str, PassOutput]:
    """Export every pass of every rank, `jobs` at a time; the outputs by job label. A pass's
    rewrite matches are checked against the recipe as soon as the pass is done."""

    def done(output: PassOutput) -> None:
        if rewrite_names:  # an unfused export runs no rewrite: no match to check
            check_matches(recipe, output.name, output.records)
        if on_pass is not None:
            on_pass(output.label, output.records)  # the label on_capture was given: "verify (rank 3)"

    work = [PassJob(recipe, name, rewrite_names, shards[rank], dump_dir, rank)
            for rank in ranks.ranks for name in recipe.pass_names]
    return run_jobs(work, jobs, on_start=on_capture, on_done=done)


@dataclass
class ExportedPasses:
    """The passes' share of a package, gathered from the job outputs in pass order."""

    files: dict[str, bytes]  # graph file -> its bytes, of every rank
    entries: dict[str, PassEntry]
    results: dict[str, dict[str, ManifestRewriteResult]]  # pass -> rewrite -> what the manifest records
    records: dict[str, list[RewriteResult]]  # pass -> the rewrite kit's results (rank 0's)
    buffers: dict[str, BufferInfo]
    cache_formats: dict[str, str]


def gather_passes(recipe, d: Dims, ranks: RankFiles, outputs: dict[str, PassOutput]) -> ExportedPasses:
    """The passes' graph files and manifest entries; every rank's calling conventions must agree."""
    files, entries, results, records = {}, {}, {}, {}
    first = {name: outputs[pass_label(name, ranks.ranks[0])] for name in recipe.pass_names}  # rank 0's
    for name, output in first.items():  # in pass order, whatever order the jobs finished in
        for rank in ranks.ranks:
            files[ranks.graph(name, rank)] = outputs[pass_label(name, rank)].graph
        results[name] = {r.name: ManifestRewriteResult(**r.to_json()) for r in output.records}
        entries[name] = pass_entry(PASSES[name](d), getattr(recipe.passes, name).rows_buckets,
                                   output.inputs, output.outputs, ranks.graph(name, ranks.ranks[0]))
        records[name] = output.records
    buffers = buffer_table([output.inputs for output in first.values()])
    cache_formats = cache_formats_entry(buffers)
    ranks.check_conventions(outputs, recipe.pass_names)
    return ExportedPasses(files, entries, results, records, buffers, cache_formats)


def carried_weights(d: Dims, ranks: RankFiles, shards: dict, source: str) -> tuple[Weights, dict[str, bytes]]:
    """The weights section and weight files of a package that carries its weights."""
    files = {ranks.weights_file(rank): weights_bytes(shards[rank]) for rank in ranks.ranks}
    # A parallel package's weights are per rank: parallel.ranks[r].weights.
    entry = Weights(source, None if ranks.parallel else ranks.weights_file(None),
                    formats=weight_formats(d), activation=d.activation, engram_tables=engram_tables(d))
    return entry, files


def package_manifest(recipe, d: Dims, ranks: RankFiles, outputs: dict[str, PassOutput], passes: ExportedPasses,
                     rewrite_names: list[str], weights_entry: Weights, structural: bool) -> Manifest:
    """The package's manifest, its ABI fingerprint taken over the passes, buffers, cache formats and weights."""
    model = ModelFacts(
        recipe.model.family, d.vocab, d.max_seq_len, d.noise_token_id, d.confidence_threshold,
        # On exactly when the snapshot codec covers every cache: window, compressed, state, draft rings.
        snapshot_capabilities(PASSES["prefill"](d).caches(), d.max_seq_len))
    entries, buffers, cache_formats = passes.entries, passes.buffers, passes.cache_formats
    return Manifest(
        format_version=ranks.format_version, opset_version=OPSET_VERSION, name=recipe.name,
        recipe=recipe.normalized(), recipe_sha256=recipe.sha256(), model=model, passes=entries, buffers=buffers,
        cache_formats=cache_formats, abi_fingerprint=abi_fingerprint(entries, buffers, cache_formats, weights_entry),
        rewrites=Rewrites(tuple(rewrite_names), passes.results), weights=weights_entry, versions=tool_versions(),
        parallel=ranks.mapping(outputs, recipe.pass_names, structural) if ranks.parallel else None)


def export_package(recipe, out_dir: Path, fuse: bool = True, weights: dict | None = None,
                   on_pass: Callable[[str, list[RewriteResult]], None] | None = None, *,
                   structural: bool = False, checksums: dict[str, str] | None = None,
                   dump_dir: Path | None = None, on_capture: Callable[[str], None] | None = None,
                   jobs: int = 1, weights_source: str | None = None,
                   tokenizer: PackageTokenizer | None = None) -> ExportResult:
    """Export `recipe` as OUT_DIR/NAME.b12x.

    structural: no weights in the package (they are bound from a checkpoint at load
    time), captured on fake tensors; `checksums` (tensor name → sha256, from a checkpoint
    index) are recorded for the runtime to check. dump_dir: the graph of every pass before
    and after each rewrite, numbered. jobs: passes exported at once, in worker processes
    (the bytes do not depend on it). on_capture(pass) runs when a pass starts,
    on_pass(pass, records) when its rewrites are done. weights_source: where supplied
    `weights` came from, recorded in the manifest (e.g. the checkpoint they were read from).
    tokenizer: a checkpoint's tokenizer (hf/tokenizer_files.py), carried as files with its
    manifest section, which needs format 4.4; without one the package is written as before.
    """
    check_export_torch()
    d = Dims.from_recipe(recipe)
    check_computable_formats(d)
    weights, source = weights_to_export(recipe, d, weights, structural, weights_source)
    rewrite_names = [r.name for r in recipe.rewrites] if fuse else []
    ranks = RankFiles(d)
    shards = {rank: None if structural else ranks.weights(weights, rank) for rank in ranks.ranks}  # cut once
    outputs = run_pass_jobs(recipe, ranks, shards, rewrite_names, dump_dir, jobs, on_capture, on_pass)
    passes = gather_passes(recipe, d, ranks, outputs)
    if structural:
        weights_entry, weight_files = external_weights(d, checksums), {}
    else:
        weights_entry, weight_files = carried_weights(d, ranks, shards, source)
    manifest = package_manifest(recipe, d, ranks, outputs, passes, rewrite_names, weights_entry, structural)
    manifest, files = with_tokenizer(manifest, {**passes.files, **weight_files}, tokenizer)
    path = write_package(Path(out_dir) / f"{recipe.name}.b12x", files, manifest)
    return ExportResult(path, manifest.abi_fingerprint, passes.records, {n: o.seconds for n, o in outputs.items()},
                        {n: o.cpu_seconds for n, o in outputs.items()},
                        {n: o.peak_rss_bytes for n, o in outputs.items()})
