"""Read a package: versions, file hashes and calling conventions are checked before use.

Loading never executes code from the package: the manifest is strict JSON, weights are
safetensors, and graphs are torch.export archives whose entries and graph JSON are
checked (no pickles, only allowed ops and plain data; runtime/package/graph_json.py)
before they are deserialised. A package is a tree of plain files and directories: links,
FIFOs, sockets and devices below its root are refused by name, and every file is opened
without following links. The root itself may be a symbolic link (deployments switch a
`current` link between versions); it is resolved once, when loading starts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from b12x_toolchain.runtime.errors import PackageError  # noqa: F401  (re-exported)
from b12x_toolchain.runtime.ops import opset as _ops  # noqa: F401  (graphs need the op set registered)
from b12x_toolchain.runtime.ops.opset import OPSET_VERSION
from b12x_toolchain.runtime.package.abi import BufferSpec, contract, fingerprint
from b12x_toolchain.runtime.package.cache_formats import check_cache_formats
from b12x_toolchain.runtime.package.contract import (
    BufferInfo,
    PassFields,
    buffer_table,
    check_row_inputs,
    described,
    pass_fields,
    row_input_info,
)
from b12x_toolchain.runtime.package.graph_archive import check_archive, check_graph_ops
from b12x_toolchain.runtime.package.kinds import KINDS
from b12x_toolchain.runtime.package.weight_binding import bind_weights
from b12x_toolchain.runtime.parallel.group import bind_group, refuse_collectives
from b12x_toolchain.runtime.parallel.mapping import read_mapping
from b12x_toolchain.runtime.strict_json import load_document

# major.minor: another major is refused, an older minor accepted. 1.1 added external
# weights (structural packages: weights.external, weights.tensors). 2.0 records what
# every buffer is and what every pass does as data (contract.py) and calls op set 2.
# 3.0 pages compressed entries and index keys ([pool, page_bytes] caches, a page spec per
# cache, block tables as pass inputs) and calls op set 3. 4.0 stores DeepSeek V4.1's records
# (formats renamed by convention) and records each format's convention (cache_formats.py).
# The op set is versioned on its own: op set 4 adds hc_sinkhorn (mHC's Sinkhorn as one op),
# and packages of op set 3 are refused with the same re-export advice. 4.1 adds parallel
# packages (ranks' graphs and weights, the mapping as data: runtime/parallel/mapping.py);
# a package for one device is still written as 4.0.
FORMAT_VERSION = "4.1"
MANIFEST_LIMIT = 16 << 20
REEXPORT = "re-export it with this version of b12x (b12x export --recipe RECIPE)"


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
    inputs: list[BufferSpec]  # cache, staging and row inputs carry their info (kind...)
    outputs: list[BufferSpec]
    rows_buckets: list[int]
    width: int
    advances: str | None = None  # the input whose counts move the committed length; None: staging only
    reads_staging_of: str | None = None  # the pass whose staging this one makes persistent

    @functools.cached_property
    def _row_inputs(self) -> dict[str, list[str]]:
        """Row input names by kind, built once: every replay looks inputs up by kind, and
        `inputs` also lists every weight (thousands at full size)."""
        by_kind: dict[str, list[str]] = {}
        for spec in self.inputs:
            if spec.role == "input":
                by_kind.setdefault(spec.info.kind, []).append(spec.name)
        return by_kind

    @functools.cached_property
    def block_tables(self) -> dict[str, str]:
        """The pass's block-table inputs by page pool (kinds.py)."""
        return {KINDS[kind].pool: names[0] for kind, names in self._row_inputs.items() if KINDS[kind].pool}

    def input_of(self, kind: str) -> str | None:
        """The name of this pass's row input of `kind` (the first, if several), or None."""
        names = self._row_inputs.get(kind)
        return names[0] if names else None

    def inputs_of(self, kind: str) -> list[str]:
        return list(self._row_inputs.get(kind, ()))


class Package:
    def __init__(self, path: Path, manifest: dict, passes: dict[str, PassInfo], weights: dict[str, torch.Tensor]):
        self.path, self.manifest, self.passes, self.weights = path, manifest, passes, weights
        self.mapping, self.rank = None, None  # a parallel package's mapping, and the rank loaded
        self.joined = True  # False: a parallel rank loaded for inspection, outside its process group

    @property
    def abi_fingerprint(self) -> str:
        return self.manifest["abi_fingerprint"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["model"]["vocab_size"]

    @functools.cached_property
    def buffers(self) -> dict[str, BufferSpec]:
        """Every cache and staging buffer any pass binds, by name, with its info."""
        return {s.name: s for info in self.passes.values() for s in info.inputs if described(s.role)}

    def buffers_of(self, kind: str) -> list[str]:
        return [name for name, spec in self.buffers.items() if spec.info.kind == kind]

    @property
    def external_weights(self) -> bool:
        return bool(self.manifest["weights"].get("external"))

    def session(self, device="cpu", slots: int = 1, max_rows: int | None = None, buffers: dict | None = None,
                pages: int | dict | None = None, cache_bytes: int | None = None, contiguous: bool = False,
                compile=False, compile_cache=None):
        """A session of `slots` request slots; `pages` (per pool, or one count for every pool)
        or `cache_bytes` bound the paged caches (default: every slot can reach max_seq_len);
        `contiguous` keeps each slot's pages in one run (Session); `compile` (True, or pass
        names) replays those passes through Inductor, compiled on this machine on first use
        and cached under `compile_cache` (session/compiled.py)."""
        from b12x_toolchain.runtime.session.session import Session

        if not self.joined:
            raise PackageError(f"{self.path.name}: rank {self.rank} was loaded for inspection (join_group=False); "
                               "load it in its process group to run it")
        if self.weights is None:
            raise PackageError(f"{self.path.name}: weights are external and not bound; "
                               "load it with load(path, weights=CHECKPOINT_DIR)")
        return Session(self, device=device, slots=slots, max_rows=max_rows, buffers=buffers, pages=pages,
                       cache_bytes=cache_bytes, contiguous=contiguous, compile=compile, compile_cache=compile_cache)


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_plain_file(path: Path, label: str, limit: int | None = None) -> bytes:
    """The bytes of a regular file, opened without following a link and checked on the open
    descriptor (a file swapped for a link or a FIFO after a listing is still refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise PackageError(f"{label}: listed in manifest.json but missing") from None
    except OSError as exc:  # ELOOP: the name is a symbolic link
        mode = os.lstat(path).st_mode if os.path.lexists(path) else 0
        raise PackageError(f"{label}: is {_kind(mode)}; packages hold plain files only ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PackageError(f"{label}: is {_kind(info.st_mode)}; packages hold plain files only")
        if limit is not None and info.st_size > limit:
            raise PackageError(f"{label}: {info.st_size} bytes exceeds the {limit} byte limit")
        return handle.read()


def _read_manifest(root: Path) -> dict:
    path = root / "manifest.json"
    if not os.path.lexists(path):
        raise PackageError(f"{root}: no manifest.json; is this a b12x package?")
    return _read_manifest_file(path)


def _read_manifest_file(path: Path) -> dict:
    manifest = load_document(read_plain_file(path, "manifest.json", MANIFEST_LIMIT), "manifest.json")
    if not isinstance(manifest, dict):
        raise PackageError("manifest.json: top level is not an object")
    return manifest


def _check_digest(manifest: dict) -> None:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    if manifest.get("manifest_sha256") != digest:
        raise PackageError("manifest.json: manifest_sha256 does not match its contents (corrupted or edited)")


def _recipe_hint(manifest: dict) -> str:
    name = manifest.get("name")
    return REEXPORT.replace("RECIPE", name) if isinstance(name, str) and name.isprintable() and name else REEXPORT


def _check_versions(manifest: dict) -> None:
    major, minor = _major_minor(manifest.get("format_version"))
    ours = _major_minor(FORMAT_VERSION)
    if major < ours[0]:
        raise PackageError(f"manifest.json: format_version {major}.{minor} is older than this runtime reads "
                           f"({ours[0]}.0 to {ours[0]}.{ours[1]}); {_recipe_hint(manifest)}")
    if major != ours[0] or minor > ours[1]:
        raise PackageError(
            f"manifest.json: format_version {major}.{minor} is not supported by this runtime "
            f"(reads {ours[0]}.0 to {ours[0]}.{ours[1]}); it needs a newer b12x"
        )
    found = manifest.get("opset_version")
    if found != OPSET_VERSION:
        older = isinstance(found, int) and not isinstance(found, bool) and 1 <= found < OPSET_VERSION
        advice = _recipe_hint(manifest) if older else "it is not an op set this runtime knows"
        raise PackageError(f"manifest.json: opset_version {found!r} is unknown; this runtime has op set "
                           f"{OPSET_VERSION}: {advice}")


def read_manifest(path) -> dict:
    """The checked manifest of a package directory, or of its manifest.json on its own.

    Versions, the buffer and pass data and the ABI fingerprint are checked; files are not
    read, so this is what tools that compare calling conventions use (a committed manifest
    stands for its package).
    """
    path = Path(path)
    if path.is_file():  # a manifest named on its own may be a link, like a package root
        manifest = _read_manifest_file(path.resolve())
    elif path.is_dir():
        manifest = _read_manifest(path.resolve())
    else:
        raise PackageError(f"{path}: neither a package directory nor a manifest.json")
    _check_versions(manifest)
    _check_fingerprint(manifest)
    _conventions(manifest)
    check_cache_formats(manifest)
    return manifest


def _check_fingerprint(manifest: dict) -> dict:
    passes_json = manifest.get("passes")
    if not isinstance(passes_json, dict) or not passes_json:
        raise PackageError("manifest.json: 'passes' is missing or empty")
    if fingerprint(contract(passes_json, manifest.get("buffers"), manifest.get("cache_formats"))) \
            != manifest.get("abi_fingerprint"):
        raise PackageError("manifest.json: abi_fingerprint does not match the calling conventions")
    return passes_json


def _safe_member(root: Path, name: str) -> Path:
    if not isinstance(name, str) or name.startswith("/") or ".." in Path(name).parts or "\\" in name:
        raise PackageError(f"manifest.json: file name {name!r} points outside the package")
    return root / name


def _tree(root: Path) -> set[str]:
    """Every file below root, by relative name; anything but plain files and directories is refused.

    Walked with lstat, never following a link, so a link inside (or pointing out) is seen
    as itself and refused by name before any file is read."""
    files, pending = set(), [root]
    while pending:
        folder = pending.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                mode = entry.stat(follow_symlinks=False).st_mode
                name = Path(entry.path).relative_to(root).as_posix()
                if stat.S_ISDIR(mode):
                    pending.append(Path(entry.path))
                elif stat.S_ISREG(mode):
                    files.add(name)
                else:
                    raise PackageError(f"{name}: is {_kind(mode)}; packages hold plain files and directories only")
    return files


def _check_files(root: Path, manifest: dict) -> dict[str, bytes]:
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not listed:
        raise PackageError("manifest.json: 'files' is missing or empty")
    paths = {name: _safe_member(root, name) for name in sorted(listed)}
    present = _tree(root) - {"manifest.json"}
    extra = sorted(present - set(listed))
    if extra:
        raise PackageError(f"{extra[0]}: file is not listed in manifest.json")
    contents = {}
    for name, expected in sorted(listed.items()):
        if name not in present:
            raise PackageError(f"{name}: listed in manifest.json but missing")
        data = read_plain_file(paths[name], name)
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise PackageError(f"{name}: sha256 {actual[:16]}… does not match the manifest's {str(expected)[:16]}…")
        contents[name] = data
    return contents


def load_graph(file: str, data: bytes) -> torch.export.ExportedProgram:
    """One graph archive: its entries and JSON checked first, then deserialised, then its ops
    checked again on the loaded graph. Any refusal is a PackageError naming `file`."""
    check_archive(file, data)
    try:
        program = torch.export.load(io.BytesIO(data))
    except Exception as exc:  # the checks above passed it, torch's deserialiser did not: still bad input
        raise PackageError(f"{file}: torch.export could not load it ({type(exc).__name__}: {str(exc)[:300]})") from None
    check_graph_ops(file, program.graph)  # the second line: the loaded graph's targets
    return program


@dataclass
class _Convention:
    """A pass as the manifest declares it, before its graph is deserialised."""

    name: str
    graph: str
    inputs: list[BufferSpec]
    outputs: list[BufferSpec]
    fields: PassFields


def _specs(name: str, entry: dict, fields: PassFields, buffers: dict[str, BufferInfo]):
    """The calling convention with every cache, staging and row input's info attached."""
    try:
        inputs = [BufferSpec.from_json(s) for s in entry["inputs"]]
        outputs = [BufferSpec.from_json(s) for s in entry["outputs"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise PackageError(f"manifest.json: passes.{name}: bad calling convention ({exc})") from None
    return [_with_info(name, spec, fields, buffers) for spec in inputs], outputs


def _with_info(pass_name: str, spec: BufferSpec, fields: PassFields, buffers: dict[str, BufferInfo]) -> BufferSpec:
    if described(spec.role):
        info = buffers[spec.name]  # buffer_table: every described name has an entry
    elif spec.role == "input":
        if spec.name not in fields.row_inputs:
            raise PackageError(f"manifest.json: passes.{pass_name}.row_inputs: input {spec.name} has no kind")
        info = row_input_info(pass_name, spec.name, fields.row_inputs[spec.name])
    else:
        return spec
    try:
        info.check(spec)
    except ValueError as exc:
        raise PackageError(f"manifest.json: {exc}") from None
    return dataclasses.replace(spec, info=info)


def _described_names(passes_json: dict) -> set[str]:
    return {s.get("name") for e in passes_json.values() for s in (e.get("inputs") or [])
            if isinstance(s, dict) and described(s.get("role"))}


def _conventions(manifest: dict) -> dict[str, _Convention]:
    """Every pass's convention and data, checked strictly (contract.py) before any file is used."""
    passes_json = manifest["passes"]
    fields = {name: pass_fields(name, entry, set(passes_json)) for name, entry in passes_json.items()}
    buffers = buffer_table(manifest.get("buffers"), _described_names(passes_json))
    out = {}
    for name, entry in passes_json.items():
        inputs, outputs = _specs(name, entry, fields[name], buffers)
        check_row_inputs(name, fields[name], inputs)
        out[name] = _Convention(name, entry["graph"], inputs, outputs, fields[name])
    return out


def _check_graph_file(convention: _Convention, contents: dict[str, bytes]) -> None:
    if convention.graph not in contents:
        raise PackageError(f"manifest.json: passes.{convention.name}.graph {convention.graph!r} is not a listed file")


def _pass_info(convention: _Convention, contents: dict[str, bytes]) -> PassInfo:
    program = load_graph(convention.graph, contents[convention.graph])
    f = convention.fields
    return PassInfo(convention.name, program, convention.inputs, convention.outputs, list(f.rows_buckets), f.width,
                    f.advances, f.reads_staging_of)


def load(path, weights=None, rank: int | None = None, peer_timeout: float | None = None,
         join_group: bool = True) -> Package:
    """Load and check a package; `weights` is a checkpoint directory to bind the weights from.

    A structural package (external weights) loaded without `weights` can be inspected but
    not run: `Package.session` refuses until the weights are bound. A parallel package is
    loaded once per rank, `rank` naming this process's, in a process whose default
    torch.distributed group has the package's world size (runtime/parallel/group.py);
    `peer_timeout` (seconds) also waits for every peer to answer. `join_group=False` checks
    all the rest and loads the rank's graphs for inspection only: its sessions are refused.
    """
    given = Path(path)
    if not given.is_dir():
        raise PackageError(f"{given}: not a package directory")
    root = given.resolve()  # the root may be a link (see above); what lies below it may not
    manifest = _read_manifest(root)
    _check_versions(manifest)
    _check_digest(manifest)
    contents = _check_files(root, manifest)
    _check_fingerprint(manifest)
    conventions = _conventions(manifest)
    check_cache_formats(manifest)
    mapping = read_mapping(manifest, conventions)
    conventions = _rank_conventions(conventions, mapping, rank)
    for convention in conventions.values():
        _check_graph_file(convention, contents)
    # Weights first: a bad checkpoint or weights file is refused before any graph is deserialised.
    bound = bind_weights(manifest, contents, conventions, weights, mapping, rank)
    passes = {name: _pass_info(convention, contents) for name, convention in conventions.items()}
    programs = {name: info.program for name, info in passes.items()}
    if mapping is None:
        refuse_collectives(programs)
    elif join_group:  # before any replay: the group, its size, this rank, and (if asked) the peers
        bind_group(programs, rank, mapping.world_size, mapping.describe(), peer_timeout)
    package = Package(given, manifest, passes, bound)
    package.mapping, package.rank, package.joined = mapping, rank, mapping is None or join_group
    return package


def _rank_conventions(conventions: dict, mapping, rank) -> dict:
    """The conventions with rank `rank`'s graph files (a one-device package: as they are)."""
    if mapping is None:
        if rank not in (None, 0):
            raise PackageError(f"rank {rank}: the package was exported for one device (no parallel mapping)")
        return conventions
    if rank is None:
        raise PackageError(f"the package was exported for {mapping.describe()}; load it in each rank's process "
                           "with load(path, rank=R)")
    if not (isinstance(rank, int) and 0 <= rank < mapping.world_size):
        raise PackageError(f"rank {rank!r} is out of range; the package was exported for {mapping.describe()}")
    graphs = mapping.ranks[rank]["graphs"]
    return {name: dataclasses.replace(c, graph=graphs[name]) for name, c in conventions.items()}
