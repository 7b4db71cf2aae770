"""Manifests built in memory from the pass modules' conventions: no capture, no export.

What `read_manifest` checks (versions, fingerprint, buffer and pass data) needs no graph
or weights file, so a recipe's manifest can be made, edited and read back in milliseconds.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.pipeline.export import buffer_table, pass_entry
from b12x_toolchain.exporter.pipeline.rank_files import SINGLE_DEVICE_FORMAT
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.ops.namespace import OPSET_VERSION
from b12x_toolchain.runtime.package.abi import contract, fingerprint
from b12x_toolchain.runtime.package.cache_formats import cache_formats_entry
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
    manifest = {"format_version": SINGLE_DEVICE_FORMAT, "opset_version": OPSET_VERSION, "name": recipe.name,
                "model": {"max_seq_len": d.max_seq_len, "vocab_size": d.vocab},
                "passes": passes, "buffers": buffers, "cache_formats": cache_formats_entry(buffers)}
    return refingerprint(manifest)


def refingerprint(manifest: dict) -> dict:
    """Sign the calling conventions again, as a tamperer or a buggy exporter would."""
    manifest["abi_fingerprint"] = fingerprint(contract(manifest["passes"], manifest.get("buffers"),
                                                       manifest.get("cache_formats")))
    return manifest


def edited(manifest: dict, edit) -> dict:
    out = copy.deepcopy(manifest)
    edit(out)
    return refingerprint(out)


def read_back(manifest: dict, folder: Path) -> dict:
    path = Path(folder) / "manifest.json"
    path.write_text(json.dumps(manifest))
    return read_manifest(path)
