"""Write a package directory atomically and deterministically.

Everything goes into a temporary sibling directory first and is renamed into place, so
a failed or killed export never leaves a partial package under the final name. Bytes
depend only on the recipe, the weights and the tool versions: graphs are saved without
sample inputs, JSON keys are sorted, and no time stamps, host names or paths are written.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import tempfile
from pathlib import Path

import safetensors.torch
import torch

from b12x_toolchain.runtime.package.manifest import Manifest, digest


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def program_bytes(program: torch.export.ExportedProgram) -> bytes:
    buffer = io.BytesIO()
    with _without_canonical_form_check():
        torch.export.save(program, buffer)
    return buffer.getvalue()


@contextlib.contextmanager
def _without_canonical_form_check():
    """Skip the self-check torch.export.save runs on every program.

    After serialising, torch's serialiser canonicalises a deep copy of what it made, only
    to "test canonical form is well defined", and throws the result away: the bytes it
    writes never depend on it. For a full-size pass that check (mostly the deep copy of
    tens of thousands of nodes) was over a quarter of the export. Where a torch has no such
    function the save runs unchanged; tests hold the bytes equal with and without it.
    """
    from torch._export.serde import serialize

    check = getattr(serialize, "canonicalize", None)
    if check is None:
        yield
        return
    serialize.canonicalize = lambda program, constants=None: program
    try:
        yield
    finally:
        serialize.canonicalize = check


def weights_bytes(weights: dict[str, torch.Tensor]) -> bytes:
    ordered = {name: weights[name].detach().contiguous().cpu() for name in sorted(weights)}
    return safetensors.torch.save(ordered, metadata={"format": "pt"})


def manifest_digest(manifest: dict) -> str:
    """sha256 of a manifest's JSON without its own digest (for tests that edit one and sign it again)."""
    return digest(manifest)


def write_package(target: Path, files: dict[str, bytes], manifest: Manifest) -> Path:
    """Write `files` plus manifest.json (listing every file's sha256, signed) as directory `target`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    manifest = manifest.signed({name: sha256(data) for name, data in files.items()})
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        for name, data in {**files, "manifest.json": manifest.to_bytes()}.items():
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        _replace_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`; an existing package is moved aside first, then removed."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        os.replace(target, old / "package")
    os.replace(new, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
