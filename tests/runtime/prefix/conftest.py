"""Packages for the prefix-cache tests: the small recipe, and variants that must never share snapshots."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import pytest

from b12x_toolchain.exporter.pipeline.package_writer import manifest_digest, weights_bytes
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.package.reader import Package


@pytest.fixture(scope="session")
def other_weights_pkg(small_pkg, small_path, tmp_path_factory):
    """The same recipe with other weights: weights are graph inputs, so only weights.safetensors
    and its hash in the manifest change — what an export from another checkpoint gives."""
    target = tmp_path_factory.mktemp("other-weights") / small_path.name
    shutil.copytree(small_path, target)
    weights = {name: t * 1.01 if t.is_floating_point() and t.dim() > 1 else t for name, t in small_pkg.weights.items()}
    data = weights_bytes(weights)
    (target / "weights.safetensors").write_bytes(data)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["files"]["weights.safetensors"] = hashlib.sha256(data).hexdigest()
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (target / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return load(target)


def with_manifest(package, **changes) -> Package:
    """The same graphs and weights under a copy of the manifest with `changes` (its fields)."""
    return Package(package.path, dataclasses.replace(package.manifest, **changes), package.passes, package.weights)


def with_capabilities(package, **flags) -> Package:
    capabilities = None if flags.get("remove") else {f"supports_{k}": v for k, v in flags.items()}
    return with_manifest(package, model=dataclasses.replace(package.manifest.model, capabilities=capabilities))
