"""recipe -> captured passes -> rewrite pipeline -> package, the exporter's one entry point."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

import torch

import b12x
from b12x.exporter.buffers import cache_specs
from b12x.exporter.capture import capture
from b12x.exporter.dims import Dims
from b12x.exporter.package_writer import program_bytes, weights_bytes, write_package
from b12x.exporter.pass_modules import PASSES
from b12x.exporter.weights import init_weights
from b12x.passes.manager import PassError, PassRecord, build_pipeline, run_pipeline
from b12x.runtime.abi import fingerprint
from b12x.runtime.ops import OPSET_VERSION
from b12x.runtime.package import FORMAT_VERSION
from b12x.runtime.snapshot import capabilities as snapshot_capabilities

FLASHINFER_PIN = "0.7.4"  # the `cuda` extra pins exactly this version


class ExportError(RuntimeError):
    pass


@dataclass
class ExportResult:
    path: Path
    abi_fingerprint: str
    records: dict[str, list[PassRecord]] = field(default_factory=dict)


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def tool_versions() -> dict:
    return {
        "b12x": b12x.__version__,
        "torch": torch.__version__,
        "safetensors": _version("safetensors"),
        "flashinfer_pin": FLASHINFER_PIN,
    }


def check_matches(recipe, pass_name: str, records: list[PassRecord]) -> None:
    found = {r.name: r.matches for r in records}
    for rewrite in recipe.rewrites:
        expected = rewrite.expect_matches[pass_name]
        if found[rewrite.name] != expected:
            raise ExportError(
                f"rewrite {rewrite.name} found {found[rewrite.name]} matches in the {pass_name} graph; "
                f"the recipe expects {expected} (rewrites[].expect_matches.{pass_name})"
            )


def export_package(recipe, out_dir: Path, fuse: bool = True, weights: dict | None = None,
                   on_pass: Callable[[str, list[PassRecord]], None] | None = None) -> ExportResult:
    d = Dims.from_recipe(recipe)
    if weights is None:
        weights = init_weights(d, recipe.model.init_seed)
    pipeline = [r.name for r in recipe.rewrites] if fuse else []
    files, conventions, results, passes, all_records = {}, {}, {}, {}, {}
    for name, cls in PASSES.items():
        module = cls(d)
        inputs, outputs = module.convention()
        program = capture(module, weights)
        try:
            records = run_pipeline(program.graph_module, build_pipeline(pipeline), name)
        except PassError as exc:
            raise ExportError(str(exc)) from exc
        if fuse:
            check_matches(recipe, name, records)
        files[f"graphs/{name}.pt2"] = program_bytes(program)
        conventions[name] = {"inputs": [s.to_json() for s in inputs], "outputs": [s.to_json() for s in outputs]}
        results[name] = {r.name: r.to_json() for r in records}
        config = getattr(recipe.passes, name)
        passes[name] = {
            "graph": f"graphs/{name}.pt2",
            "rows_buckets": list(config.rows_buckets),
            "width": {"prefill": d.prefill_chunk, "draft": d.draft_width}.get(name, d.verify_width),
            **conventions[name],
        }
        all_records[name] = records
        if on_pass is not None:
            on_pass(name, records)
    files["weights.safetensors"] = weights_bytes(weights)
    manifest = {
        "format_version": FORMAT_VERSION,
        "opset_version": OPSET_VERSION,
        "name": recipe.name,
        "recipe": recipe.normalized(),
        "recipe_sha256": recipe.sha256(),
        "model": {
            "family": recipe.model.family,
            "vocab_size": d.vocab,
            "max_seq_len": d.max_seq_len,
            "noise_token_id": d.noise_token_id,
            # On exactly when the snapshot codec covers every cache: window, compressed, state, draft rings.
            "capabilities": snapshot_capabilities(cache_specs(d), d.ratios, d.max_seq_len),
        },
        "passes": passes,
        "abi_fingerprint": fingerprint(conventions),
        "rewrites": {"pipeline": pipeline, "results": results},
        "weights": {"file": "weights.safetensors", "source": f"random init, seed {recipe.model.init_seed}"},
        "versions": tool_versions(),
    }
    path = write_package(Path(out_dir) / f"{recipe.name}.b12x", files, manifest)
    return ExportResult(path, manifest["abi_fingerprint"], all_records)
