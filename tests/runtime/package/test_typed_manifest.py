"""The manifest as one typed object: the document round-trips through it byte for byte,
read_manifest and load refuse the same manifests, and the passes must agree on every
buffer they share, checked when the manifest is read."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from b12x_toolchain.runtime import PackageError, load
from b12x_toolchain.runtime.package.manifest import Manifest
from b12x_toolchain.runtime.package.reader import read_manifest
from runtime.package.manifests import contract_manifest, edited, read_back, refingerprint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPOSITORY = Path(__file__).resolve().parents[3]
SOURCES = ("exporter", "passes", "runtime", "benchmarks", "examples")
MODEL_MODULE = Path("runtime/package/manifest.py")
RAW_ACCESS = re.compile(r"manifest\[|manifest\.get\(")
BOTH = "(verify and commit|commit and verify)"  # in the order the manifest lists the passes
STATE_STAGING = ("staging.verify.layer2.state", "staging.verify.layer1.state")  # tiny, small recipe


def test_an_exported_manifest_round_trips_byte_for_byte(fused_path):
    written = (Path(fused_path) / "manifest.json").read_bytes()
    manifest = read_manifest(fused_path)
    assert manifest.to_bytes() == written
    assert Manifest.from_json(json.loads(written)) == manifest


def _shared_staging_reshaped(manifest: dict) -> str:
    """commit binds a staging buffer of verify's with one position more than verify writes; its name."""
    spec = next(s for s in manifest["passes"]["commit"]["inputs"] if s["name"] in STATE_STAGING)
    spec["shape"][1] += 1
    return spec["name"]


def test_passes_binding_one_buffer_differently_are_refused_naming_both(tiny_recipe, tmp_path):
    with pytest.raises(PackageError, match=r"manifest\.json: buffer staging\.verify\.layer2\.state: passes verify and "
                                           r"commit bind it differently \(staging uint8 \['rows', 8, 512\] and "
                                           r"staging uint8 \['rows', 9, 512\]\)"):
        read_back(edited(contract_manifest(tiny_recipe), _shared_staging_reshaped), tmp_path)


def test_load_refuses_passes_that_disagree_on_a_buffer(small_path, tmp_path):
    """A tampered package, fingerprint and digest signed again: refused at load, before any session."""
    target = shutil.copytree(small_path, tmp_path / "copy.b12x")
    manifest = json.loads((target / "manifest.json").read_text())
    name = _shared_staging_reshaped(manifest)
    (target / "manifest.json").write_text(json.dumps(refingerprint(manifest)))
    with pytest.raises(PackageError, match=rf"buffer {re.escape(name)}: passes {BOTH} bind it differently"):
        load(target)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["model"].update(max_seq_len="1024"), r"model\.max_seq_len: '1024' is not a positive integer"),
    (lambda m: m["model"].pop("vocab_size"), r"model: fields missing \['vocab_size'\]"),
    (lambda m: m["weights"].update(file=7), r"weights\.file: 7 is not a file name or null"),
    (lambda m: m["rewrites"].update(pipeline="fuse"), r"rewrites\.pipeline: 'fuse' is not a list of rewrite names"),
    (lambda m: m.update(files={}), r"'files' is missing or empty"),
    (lambda m: m.update(comment="hi"), r"top level: unknown fields \['comment'\]"),
])
def test_read_manifest_and_load_refuse_the_same_manifest(small_path, tmp_path, edit, message):
    target = shutil.copytree(small_path, tmp_path / "copy.b12x")
    manifest = json.loads((target / "manifest.json").read_text())
    edit(manifest)
    (target / "manifest.json").write_text(json.dumps(refingerprint(manifest)))
    for read in (read_manifest, load):
        with pytest.raises(PackageError, match=rf"^manifest\.json: {message}"):
            read(target)


def test_read_manifest_checks_the_digest_as_load_does(tiny_recipe, tmp_path):
    manifest = contract_manifest(tiny_recipe)
    manifest["name"] = "renamed"  # not signed again
    with pytest.raises(PackageError, match="manifest_sha256 does not match its contents"):
        read_back(manifest, tmp_path)


def test_only_the_typed_model_reads_the_manifest_json():
    """Everything but runtime/package/manifest.py reads the typed Manifest's attributes."""
    found = []
    for folder in SOURCES:
        for path in sorted((REPOSITORY / folder).rglob("*.py")):
            relative = path.relative_to(REPOSITORY)
            if relative == MODEL_MODULE:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if RAW_ACCESS.search(line):
                    found.append(f"{relative}:{number}: {line.strip()}")
    assert found == [], "raw manifest access outside the typed model:\n" + "\n".join(found)
