"""Read a package: versions (the torch releases too), file hashes and calling conventions are checked before use.

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
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from b12x_toolchain.runtime.errors import PackageError  # noqa: F401  (re-exported)
from b12x_toolchain.runtime.ops import opset as _ops  # noqa: F401  (graphs need the op set registered)
from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.package.conventions import PassEntry, shared_buffers
from b12x_toolchain.runtime.package.kinds import KINDS
from b12x_toolchain.runtime.package.manifest import Manifest
from b12x_toolchain.runtime.package.pass_graph import DIRECT, PassGraph, refuse_collectives
from b12x_toolchain.runtime.package.torch_versions import check_package_torch
from b12x_toolchain.runtime.package.weight_binding import bind_weights
from b12x_toolchain.runtime.parallel.group import bind_group
from b12x_toolchain.runtime.strict_json import load_document

MANIFEST_LIMIT = 16 << 20

@dataclass
class PassInfo:
    name: str
    graph: PassGraph  # checked at load; deserialised when `program` is first read
    inputs: list[BufferSpec]  # cache, staging and row inputs carry their info (kind...)
    outputs: list[BufferSpec]
    rows_buckets: list[int]
    width: int
    advances: str | None = None  # the input whose counts move the committed length; None: staging only
    reads_staging_of: str | None = None  # the pass whose staging this one makes persistent

    @property
    def program(self) -> torch.export.ExportedProgram:
        return self.graph.program

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
        """The name of this pass's row input of `kind` (one at most: contract.py), or None."""
        names = self._row_inputs.get(kind)
        return names[0] if names else None

    @functools.cached_property
    def input_kinds(self) -> dict[str, str]:
        """Row input name -> kind: what a replay takes its values by (kinds.py)."""
        return {name: kind for kind, names in self._row_inputs.items() for name in names}

    @property
    def advances_kind(self) -> str | None:
        """The kind of the `advances` input (new_tokens, accepted_tokens), or None."""
        return self.input_kinds[self.advances] if self.advances is not None else None

    @functools.cached_property
    def output_kinds(self) -> dict[str, str]:
        """Output name -> kind: what a replay returns its results by. The manifest records no
        kind for outputs, so the exporter names each output by its kind (kinds.OUTPUT_KINDS);
        this is the one place that relies on it, and the one to change when kinds are recorded."""
        return {spec.name: spec.name for spec in self.outputs}


class Package:
    def __init__(self, path: Path, manifest: Manifest, passes: dict[str, PassInfo], weights: dict[str, torch.Tensor]):
        self.path, self.manifest, self.passes, self.weights = path, manifest, passes, weights
        self.mapping, self.rank = None, None  # a parallel package's mapping, and the rank loaded
        self.joined = True  # False: a parallel rank loaded for inspection, outside its process group
        self.tokenizer_files: dict[str, bytes] = {}  # the tokenizer's files, as load checked them

    @functools.cached_property
    def tokenizer(self):
        """The package's TextCodec (runtime/serving/text.py), or None when it carries no tokenizer."""
        from b12x_toolchain.runtime.serving.text import TextCodec

        return TextCodec.from_package(self)

    @property
    def abi_fingerprint(self) -> str:
        return self.manifest.abi_fingerprint

    @property
    def vocab_size(self) -> int:
        return self.manifest.model.vocab_size

    @functools.cached_property
    def buffers(self) -> dict[str, BufferSpec]:
        """Every cache and staging buffer the passes bind, by name, with its spec and info: the one
        table sessions, snapshots and prefix keys use (load checked that the passes agree on it)."""
        return shared_buffers(self.passes)

    @property
    def caches(self) -> list[BufferSpec]:
        """The persistent caches, by name."""
        return [spec for spec in self.buffers.values() if spec.role == "cache"]

    @property
    def external_weights(self) -> bool:
        return self.manifest.weights.external

    def session(self, device="cpu", slots: int = 1, max_rows: int | None = None, buffers: dict | None = None,
                pages: int | dict | None = None, cache_bytes: int | None = None, contiguous: bool = False,
                compile=False, compile_cache=None, passes=None, capture=None, engram_tables="device",
                memory_fraction: float | None = None, compile_in_background: bool | str = False):
        """A session of `slots` request slots; `pages` (per pool, or one count for every pool)
        or `cache_bytes` bound the paged caches (default: what `memory_fraction` of the device's
        free memory holds, 0.9 on CUDA and 0.25 on CPU, at most every slot at max_seq_len);
        `contiguous` keeps each slot's pages in one run (Session); `compile` (True, or pass
        names) replays those passes through Inductor, compiled on this machine on first use
        and cached under `compile_cache` (session/compiled.py), or with `compile_in_background`
        compiled by a child process while the plain graphs replay, then switched to at once
        (session/background_compile.py; "here": on this thread as the session opens). `passes` (names) prepares only
        those, and deserialises only their graphs (default: every pass); `capture` is how each
        bucket's step is captured (graph_runner.py: CUDA graphs on a CUDA device by default).
        `engram_tables`: "device" (default) keeps the Engram tables on `device` like every
        weight; "host" keeps them in pinned host memory on a CUDA device, the lookup reading
        the rows it needs in place (on a CPU device the two are the same)."""
        from b12x_toolchain.runtime.session.session import Session

        if not self.joined:
            raise PackageError(f"{self.path.name}: rank {self.rank} was loaded for inspection (join_group=False); "
                               "load it in its process group to run it")
        if self.weights is None:
            raise PackageError(f"{self.path.name}: weights are external and not bound; "
                               "load it with load(path, weights=CHECKPOINT_DIR)")
        return Session(self, device=device, slots=slots, max_rows=max_rows, buffers=buffers, pages=pages,
                       cache_bytes=cache_bytes, contiguous=contiguous, compile=compile, compile_cache=compile_cache,
                       passes=passes, capture=capture, engram_tables=engram_tables, memory_fraction=memory_fraction,
                       compile_in_background=compile_in_background)


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_plain_file(path: Path, label: str, limit: int | None = None, buffer: bool = False) -> bytes | bytearray:
    """The bytes of a regular file, opened without following a link and checked on the open
    descriptor (a file swapped for a link or a FIFO after a listing is still refused).

    `buffer`: read into a bytearray of the file's size (one allocation, no copy after it);
    weight files are, since their tensors view the bytes in place (weight_binding.py) and
    torch takes a writable buffer without warning that it aliases immutable bytes."""
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
        if not buffer:
            return handle.read()
        data = bytearray(info.st_size)
        if handle.readinto(data) != info.st_size or handle.read(1):
            raise PackageError(f"{label}: changed size while it was read")
        return data


def _read_manifest(root: Path) -> Manifest:
    path = root / "manifest.json"
    if not os.path.lexists(path):
        raise PackageError(f"{root}: no manifest.json; is this a b12x package?")
    return _read_manifest_file(path)


def _read_manifest_file(path: Path) -> Manifest:
    """The one check chain of a manifest (Manifest.from_json), after strict JSON."""
    return Manifest.from_json(load_document(read_plain_file(path, "manifest.json", MANIFEST_LIMIT), "manifest.json"))


def read_manifest(path) -> Manifest:
    """The checked, typed manifest of a package directory, or of its manifest.json on its own.

    Everything the manifest says is checked (manifest.py); files are not read, so this is
    what tools that compare calling conventions use (a committed manifest stands for its
    package). `load` runs the same checks, then those of files, graphs and weights.
    """
    path = Path(path)
    if path.is_file():  # a manifest named on its own may be a link, like a package root
        return _read_manifest_file(path.resolve())
    if path.is_dir():
        return _read_manifest(path.resolve())
    raise PackageError(f"{path}: neither a package directory nor a manifest.json")


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


def _weight_files(manifest: Manifest) -> set[str]:
    """The package's own weight files (none when the weights are external)."""
    names = {manifest.weights.file} | {r.weights for r in (manifest.parallel.ranks if manifest.parallel else ())}
    return names - {None}


def _check_files(root: Path, manifest: Manifest) -> dict[str, bytes | bytearray]:
    """Every listed file's bytes, each checked against its sha256. A weight file is read once,
    into the buffer its tensors then view (weight_binding.py): the bytes hashed are the bytes bound."""
    listed = manifest.files  # a non-empty name -> sha256 table (manifest.py)
    weight_files = _weight_files(manifest)
    paths = {name: _safe_member(root, name) for name in sorted(listed)}
    present = _tree(root) - {"manifest.json"}
    extra = sorted(present - set(listed))
    if extra:
        raise PackageError(f"{extra[0]}: file is not listed in manifest.json")
    contents = {}
    for name, expected in sorted(listed.items()):
        if name not in present:
            raise PackageError(f"{name}: listed in manifest.json but missing")
        data = read_plain_file(paths[name], name, buffer=name in weight_files)
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise PackageError(f"{name}: sha256 {actual[:16]}… does not match the manifest's {str(expected)[:16]}…")
        contents[name] = data
    return contents


def _check_graph_file(convention: PassEntry, contents: dict[str, bytes]) -> None:
    if convention.graph not in contents:
        raise PackageError(f"manifest.json: passes.{convention.name}.graph {convention.graph!r} is not a listed file")


def _pass_info(convention: PassEntry, graph: PassGraph) -> PassInfo:
    c = convention
    return PassInfo(c.name, graph, list(c.inputs), list(c.outputs), list(c.rows_buckets), c.width, c.advances,
                    c.reads_staging_of)


def load(path, weights=None, rank: int | None = None, peer_timeout: float | None = None,
         join_group: bool = True, graph_loader: str = DIRECT) -> Package:
    """Load and check a package; `weights` is a checkpoint directory to bind the weights from.

    A structural package (external weights) loaded without `weights` can be inspected but
    not run: `Package.session` refuses until the weights are bound. A parallel package is
    loaded once per rank, `rank` naming this process's, in a process whose default
    torch.distributed group has the package's world size (runtime/parallel/group.py);
    `peer_timeout` (seconds) also waits for every peer to answer. `join_group=False` checks
    all the rest and loads the rank's graphs for inspection only: its sessions are refused.
    Every graph archive is checked here; a pass's graph is deserialised when first used
    (pass_graph.py), by `graph_loader` (pass_graph.LOADERS; the default is graph_loader.py).
    """
    given = Path(path)
    if not given.is_dir():
        raise PackageError(f"{given}: not a package directory")
    root = given.resolve()  # the root may be a link (see above); what lies below it may not
    manifest = _read_manifest(root)  # every check read_manifest makes
    # The torch releases: those of the export and of this process. Here, not in read_manifest:
    # tools compare manifests on any torch, and manifests built in memory record none.
    check_package_torch(manifest.versions.get("torch"))
    contents = _check_files(root, manifest)
    mapping = manifest.parallel
    conventions = _rank_conventions(manifest.passes, mapping, rank)
    for convention in conventions.values():
        _check_graph_file(convention, contents)
    # Weights first: a bad checkpoint or weights file is refused before any graph is deserialised.
    bound = bind_weights(manifest, contents, conventions, weights, mapping, rank)
    graphs = {name: PassGraph(c.graph, contents[c.graph], graph_loader) for name, c in conventions.items()}
    passes = {name: _pass_info(convention, graphs[name]) for name, convention in conventions.items()}
    if mapping is None:
        refuse_collectives(graphs)
    elif join_group:  # before any replay: the group, its size, this rank, and (if asked) the peers
        bind_group({name: g.program for name, g in graphs.items()}, rank, mapping.world_size, mapping.describe(),
                   peer_timeout)
    package = Package(given, manifest, passes, bound)
    package.mapping, package.rank, package.joined = mapping, rank, mapping is None or join_group
    if manifest.tokenizer is not None:
        names = (manifest.tokenizer.file, manifest.tokenizer.config)
        package.tokenizer_files = {name: bytes(contents[name]) for name in names if name is not None}
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
    graphs = mapping.ranks[rank].graphs
    return {name: dataclasses.replace(c, graph=graphs[name]) for name, c in conventions.items()}
