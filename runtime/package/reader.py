"""Read a package: versions, file hashes and calling conventions are checked before use.

Loading never executes code from the package: the manifest is JSON, weights are
safetensors, and graphs are torch.export archives whose entries are checked (no pickled
objects beyond the canonical empty sample-inputs record) before they are deserialised.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from b12x_toolchain.runtime.ops import opset as _ops  # noqa: F401  (graphs need the op set registered)
from b12x_toolchain.runtime.package.abi import BufferSpec, fingerprint
from b12x_toolchain.runtime.package.graph_archive import check_archive, check_graph_ops
from b12x_toolchain.runtime.package.weight_binding import bind_weights
from b12x_toolchain.runtime.ops.opset import OPSET_VERSION
from b12x_toolchain.runtime.errors import PackageError  # noqa: F401  (re-exported)

# major.minor: a newer major is refused, an older minor accepted. 1.1 added external
# weights (structural packages: weights.external, weights.tensors).
FORMAT_VERSION = "1.1"
MANIFEST_LIMIT = 16 << 20


def _major_minor(text) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in str(text).split("."))
        return major, minor
    except ValueError:
        raise PackageError(f"manifest.json: format_version {text!r} is not of the form MAJOR.MINOR") from None


@dataclass
class PassInfo:
    name: str
    program: torch.export.ExportedProgram
    inputs: list[BufferSpec]
    outputs: list[BufferSpec]
    rows_buckets: list[int]
    width: int


class Package:
    def __init__(self, path: Path, manifest: dict, passes: dict[str, PassInfo], weights: dict[str, torch.Tensor]):
        self.path, self.manifest, self.passes, self.weights = path, manifest, passes, weights

    @property
    def abi_fingerprint(self) -> str:
        return self.manifest["abi_fingerprint"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["model"]["vocab_size"]

    @property
    def external_weights(self) -> bool:
        return bool(self.manifest["weights"].get("external"))

    def session(self, device="cpu", slots: int = 1, max_rows: int | None = None, buffers: dict | None = None):
        from b12x_toolchain.runtime.session.session import Session

        if self.weights is None:
            raise PackageError(f"{self.path.name}: weights are external and not bound; "
                               "load it with load(path, weights=CHECKPOINT_DIR)")
        return Session(self, device=device, slots=slots, max_rows=max_rows, buffers=buffers)


def _read_manifest(root: Path) -> dict:
    path = root / "manifest.json"
    if not path.is_file():
        raise PackageError(f"{root}: no manifest.json; is this a b12x package?")
    return _read_manifest_file(path)


def _read_manifest_file(path: Path) -> dict:
    if path.stat().st_size > MANIFEST_LIMIT:
        raise PackageError(f"manifest.json: {path.stat().st_size} bytes exceeds the {MANIFEST_LIMIT} byte limit")
    try:
        manifest = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PackageError(f"manifest.json: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise PackageError("manifest.json: top level is not an object")
    return manifest


def _check_digest(manifest: dict) -> None:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    if manifest.get("manifest_sha256") != digest:
        raise PackageError("manifest.json: manifest_sha256 does not match its contents (corrupted or edited)")


def _check_versions(manifest: dict) -> None:
    major, minor = _major_minor(manifest.get("format_version"))
    ours = _major_minor(FORMAT_VERSION)
    if major != ours[0] or minor > ours[1]:
        raise PackageError(
            f"manifest.json: format_version {major}.{minor} is not supported by this runtime "
            f"(reads {ours[0]}.0 to {ours[0]}.{ours[1]})"
        )
    if manifest.get("opset_version") != OPSET_VERSION:
        raise PackageError(
            f"manifest.json: opset_version {manifest.get('opset_version')!r} is unknown; this runtime has op set {OPSET_VERSION}"
        )


def read_manifest(path) -> dict:
    """The checked manifest of a package directory, or of its manifest.json on its own.

    Versions and the ABI fingerprint are checked; files are not read, so this is what tools
    that compare calling conventions use (a committed manifest stands for its package).
    """
    path = Path(path)
    if path.is_file():
        manifest = _read_manifest_file(path)
    elif path.is_dir():
        manifest = _read_manifest(path)
    else:
        raise PackageError(f"{path}: neither a package directory nor a manifest.json")
    _check_versions(manifest)
    _check_fingerprint(manifest)
    return manifest


def _check_fingerprint(manifest: dict) -> dict:
    passes_json = manifest.get("passes")
    if not isinstance(passes_json, dict) or not passes_json:
        raise PackageError("manifest.json: 'passes' is missing or empty")
    conventions = {n: {"inputs": e.get("inputs"), "outputs": e.get("outputs")} for n, e in passes_json.items()}
    if fingerprint(conventions) != manifest.get("abi_fingerprint"):
        raise PackageError("manifest.json: abi_fingerprint does not match the calling conventions")
    return passes_json


def _safe_member(root: Path, name: str) -> Path:
    if not isinstance(name, str) or name.startswith("/") or ".." in Path(name).parts or "\\" in name:
        raise PackageError(f"manifest.json: file name {name!r} points outside the package")
    path = root / name
    # Every component below the package root must be a real directory or file.
    for part in [path, *path.relative_to(root).parents]:
        candidate = root / part if part != path else path
        if candidate != root and candidate.is_symlink():
            raise PackageError(f"{candidate.relative_to(root)}: is a symbolic link; packages contain plain files only")
    return path


def _check_files(root: Path, manifest: dict) -> dict[str, bytes]:
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed:
        raise PackageError("manifest.json: 'files' is missing or empty")
    paths = {name: _safe_member(root, name) for name in sorted(listed)}
    present = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()} - {"manifest.json"}
    extra = sorted(present - set(listed))
    if extra:
        raise PackageError(f"{extra[0]}: file is not listed in manifest.json")
    contents = {}
    for name, expected in sorted(listed.items()):
        path = paths[name]
        if not path.is_file():
            raise PackageError(f"{name}: listed in manifest.json but missing")
        data = path.read_bytes()
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise PackageError(f"{name}: sha256 {actual[:16]}… does not match the manifest's {str(expected)[:16]}…")
        contents[name] = data
    return contents


def _pass_info(name: str, entry: dict, contents: dict[str, bytes]) -> PassInfo:
    import io

    graph = entry.get("graph")
    if graph not in contents:
        raise PackageError(f"manifest.json: passes.{name}.graph {graph!r} is not a listed file")
    check_archive(graph, contents[graph])
    try:
        inputs = [BufferSpec.from_json(s) for s in entry["inputs"]]
        outputs = [BufferSpec.from_json(s) for s in entry["outputs"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise PackageError(f"manifest.json: passes.{name}: bad calling convention ({exc})") from None
    program = torch.export.load(io.BytesIO(contents[graph]))
    check_graph_ops(graph, program.graph)
    return PassInfo(name, program, inputs, outputs, list(entry["rows_buckets"]), int(entry["width"]))


def load(path, weights=None) -> Package:
    """Load and check a package; `weights` is a checkpoint directory to bind the weights from.

    A structural package (external weights) loaded without `weights` can be inspected but
    not run: `Package.session` refuses until the weights are bound.
    """
    root = Path(path)
    if not root.is_dir():
        raise PackageError(f"{root}: not a package directory")
    manifest = _read_manifest(root)
    _check_versions(manifest)
    _check_digest(manifest)
    contents = _check_files(root, manifest)
    passes_json = _check_fingerprint(manifest)
    passes = {name: _pass_info(name, entry, contents) for name, entry in passes_json.items()}
    return Package(root, manifest, passes, bind_weights(manifest, contents, passes, weights))
