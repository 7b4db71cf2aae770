"""Manifests built in memory from the pass modules' conventions: no capture, no export.

What `read_manifest` checks (everything a manifest says) needs no graph or weights file,
so a recipe's manifest can be made, edited and read back in milliseconds. Its files and
weights are placeholders: they are load's to check.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.model.weights import weight_formats
from b12x_toolchain.exporter.pipeline.export import buffer_table, pass_entry
from b12x_toolchain.exporter.pipeline.rank_files import RankFiles
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.ops.namespace import OPSET_VERSION
from b12x_toolchain.runtime.package.abi import contract, fingerprint
from b12x_toolchain.runtime.package.cache_formats import cache_formats_entry
from b12x_toolchain.runtime.package.manifest import Manifest, ModelFacts, Rewrites, Weights, abi_fingerprint, digest
from b12x_toolchain.runtime.package.reader import read_manifest


def contract_manifest(recipe) -> dict:
    d = Dims.from_recipe(recipe)
    passes, conventions = {}, []
    for name, cls in PASSES.items():
        module = cls(d)
        inputs, outputs = module.convention()
        passes[name] = pass_entry(module, getattr(recipe.passes, name).rows_buckets, inputs, outputs)
        conventions.append(inputs)
    buffers = buffer_table(conventions)
    formats = cache_formats_entry(buffers)
    weights = Weights("placeholder", "weights.safetensors", formats=weight_formats(d), activation=d.activation)
    manifest = Manifest(RankFiles(d).format_version, OPSET_VERSION, recipe.name, recipe.normalized(), recipe.sha256(),
                        ModelFacts(recipe.model.family, d.vocab, d.max_seq_len, d.noise_token_id, 0.0), passes,
                        buffers, formats, abi_fingerprint(passes, buffers, formats, weights), Rewrites((), {}),
                        weights, {"b12x": "test"})
    return manifest.signed({p.graph: "0" * 64 for p in passes.values()}).to_json()


def refingerprint(manifest: dict) -> dict:
    """Sign the calling conventions and the document again, as a tamperer or a buggy exporter would."""
    manifest["abi_fingerprint"] = fingerprint(contract(manifest["passes"], manifest.get("buffers"),
                                                       manifest.get("cache_formats"),
                                                       manifest.get("weights", {}).get("formats")))
    manifest["manifest_sha256"] = digest(manifest)
    return manifest


def edited(manifest: dict, edit) -> dict:
    out = copy.deepcopy(manifest)
    edit(out)
    return refingerprint(out)


def read_back(manifest: dict, folder: Path) -> dict:
    path = Path(folder) / "manifest.json"
    path.write_text(json.dumps(manifest))
    return read_manifest(path)
