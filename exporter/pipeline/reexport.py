"""Re-export a package from what its manifest records, and compare the bytes.

A package's bytes depend only on the recipe, the weights and the tool versions its
manifest records, so re-exporting from the manifest must reproduce it exactly; CI runs
this (`b12x export --check PKG`) to prove that a toolchain change moved nothing it did
not mean to. PKG may be a package directory or just its manifest.json: the manifest
holds the sha256 of every other file, so a committed manifest stands for the package.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from b12x_toolchain.exporter.errors import ReexportError  # noqa: F401  (re-exported)
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.variants import recipe_from_dict


@dataclass
class Settings:
    recipe: object
    fuse: bool
    structural: bool
    checksums: dict | None


def settings_from_manifest(manifest, recipe=None, checksums: dict | None = None) -> Settings:
    """How `manifest`'s package (a typed Manifest: runtime/package/manifest.py) was exported. `recipe` replaces the recorded one (CI checks
    that the recipe file in the repository still gives the committed package); `checksums`
    replace the recorded external-weight checksums (a checkpoint index given on the command line)."""
    if recipe is None:
        recipe = recipe_from_dict(manifest.recipe, file="manifest.json#recipe")
    rewrites = [r.name for r in recipe.rewrites]
    pipeline = list(manifest.rewrites.pipeline)
    if pipeline not in (rewrites, []):
        raise ReexportError(f"manifest.json: rewrite pipeline {pipeline} is neither the recipe's {rewrites} nor empty")
    weights = manifest.weights
    structural = weights.external
    if structural and checksums is None:
        checksums = {name: t.sha256 for name, t in weights.tensors.items() if t.sha256}
    seeded = f"random init, seed {recipe.model.init_seed}"
    if not structural and weights.source != seeded:
        raise ReexportError(f"manifest.json: weights were {weights.source!r}; only structural packages and "
                            f"packages with {seeded!r} weights can be re-exported")
    return Settings(recipe, fuse=bool(pipeline), structural=structural, checksums=checksums)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _manifest_keys(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def differences(expected: Path, actual: Path) -> list[str]:
    """Files whose bytes differ between `expected` (package or manifest.json) and package `actual`.

    A differing manifest.json is named with the top-level fields that differ (`versions`
    when only a tool version moved), the file list aside: those files are named themselves.
    """
    expected, actual = Path(expected), Path(actual)
    want_manifest = expected / "manifest.json" if expected.is_dir() else expected
    want_bytes, got_bytes = want_manifest.read_bytes(), (actual / "manifest.json").read_bytes()
    if expected.is_dir():
        want, got = _tree(expected), _tree(actual)
        out = sorted(name for name in set(want) | set(got) if want.get(name) != got.get(name) and name != "manifest.json")
    else:
        files_a, files_b = json.loads(want_bytes).get("files", {}), json.loads(got_bytes).get("files", {})
        out = sorted(name for name in set(files_a) | set(files_b) if files_a.get(name) != files_b.get(name))
    if want_bytes != got_bytes:
        # The manifest's own digest moves with any field; name the fields that moved it.
        keys = _manifest_keys(*({k: v for k, v in json.loads(m).items() if k not in ("files", "manifest_sha256")}
                                for m in (want_bytes, got_bytes)))
        out.append(f"manifest.json ({', '.join(keys) or 'files'})")
    return out


def check_package(path, settings: Settings, **export_options) -> list[str]:
    """Re-export into a temporary directory; the differing files (empty: byte-identical)."""
    with tempfile.TemporaryDirectory(prefix="b12x-check-") as tmp:
        result = export_package(settings.recipe, Path(tmp), fuse=settings.fuse, structural=settings.structural,
                                checksums=settings.checksums, **export_options)
        return differences(Path(path), result.path)
