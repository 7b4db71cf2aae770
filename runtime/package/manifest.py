"""The manifest as one typed object, shared by the exporter's writer and the runtime's reader.

`Manifest.from_json` is the one check chain of a manifest (read_manifest runs it alone,
load runs it before files, graphs and weights): versions first (an old package gets the
re-export advice, not a complaint about a field it predates), then the digest, the ABI
fingerprint, the passes and buffers (conventions.py), the cache formats, the parallel
mapping and the remaining sections. `Manifest.to_json` is what the writer serialises, so
one module is all that knows the JSON's field names; everything else reads attributes.
Every refusal is a PackageError naming the field and what was expected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.ops.opset import OPSET_VERSION
from b12x_toolchain.runtime.package.abi import contract, fingerprint
from b12x_toolchain.runtime.package.cache_formats import check_cache_formats
from b12x_toolchain.runtime.package.contract import BufferInfo
from b12x_toolchain.runtime.package.conventions import PassEntry, read_passes, shared_buffers
from b12x_toolchain.runtime.parallel.mapping import Mapping

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
REEXPORT = "re-export it with this version of b12x (b12x export --recipe RECIPE)"

WHERE = "manifest.json"
FIELDS = ("format_version", "opset_version", "name", "recipe", "recipe_sha256", "model", "passes", "buffers",
          "cache_formats", "abi_fingerprint", "rewrites", "weights", "versions", "files", "manifest_sha256")
OPTIONAL = ("parallel",)  # a package for one device has none
MODEL_FIELDS = ("family", "vocab_size", "max_seq_len", "noise_token_id", "confidence_threshold")
REWRITE_FIELDS = ("matches", "nodes_before", "nodes_after")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _str_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def _expect(ok: bool, field: str, value, expected: str) -> None:
    if not ok:
        raise PackageError(f"{WHERE}: {field}: {value!r:.200} is not {expected}")


def _keys(data: dict, field: str, required, optional=()) -> None:
    missing = sorted(set(required) - set(data))
    unknown = sorted(set(data) - set(required) - set(optional))
    if missing or unknown:
        problems = ([f"fields missing {missing}"] if missing else []) + ([f"unknown fields {unknown}"] if unknown else [])
        raise PackageError(f"{WHERE}: {field}: {'; '.join(problems)}")


def digest(data: dict) -> str:
    """sha256 of a manifest's JSON without its own digest: catches a flipped byte in it."""
    body = {k: v for k, v in data.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def abi_fingerprint(passes: dict[str, PassEntry], buffers: dict[str, BufferInfo], cache_formats: dict) -> str:
    """The ABI fingerprint of typed conventions (abi.py): what the writer records."""
    return fingerprint(contract({n: p.to_json() for n, p in passes.items()},
                                {n: b.to_json() for n, b in buffers.items()}, cache_formats))


# -- the sections -------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    family: str
    vocab_size: int
    max_seq_len: int
    noise_token_id: int
    confidence_threshold: float
    capabilities: dict[str, bool] | None = None  # the snapshot flags (prefix/snapshot.py); None: not declared

    def to_json(self) -> dict:
        out = {f: getattr(self, f) for f in MODEL_FIELDS}
        if self.capabilities is not None:
            out["capabilities"] = dict(self.capabilities)
        return out

    @classmethod
    def from_json(cls, data) -> "ModelFacts":
        _expect(isinstance(data, dict), "model", data, "an object")
        _keys(data, "model", MODEL_FIELDS, ("capabilities",))
        _expect(isinstance(data["family"], str), "model.family", data["family"], "a string")
        for field in ("vocab_size", "max_seq_len"):
            _expect(_count(data[field]) and data[field] > 0, f"model.{field}", data[field], "a positive integer")
        _expect(_count(data["noise_token_id"]) and 0 <= data["noise_token_id"] < data["vocab_size"],
                "model.noise_token_id", data["noise_token_id"], "a token id below vocab_size")
        threshold = data["confidence_threshold"]
        _expect(isinstance(threshold, (int, float)) and not isinstance(threshold, bool),
                "model.confidence_threshold", threshold, "a number")
        caps = data.get("capabilities")
        _expect(caps is None or (isinstance(caps, dict) and all(isinstance(v, bool) for v in caps.values())),
                "model.capabilities", caps, "an object of flags")
        return cls(data["family"], data["vocab_size"], data["max_seq_len"], data["noise_token_id"], threshold,
                   None if caps is None else dict(caps))


@dataclass(frozen=True)
class RewriteResult:
    """What one rewrite did to one pass's graph (passes/manager.py's PassRecord)."""

    matches: int
    nodes_before: int
    nodes_after: int

    def to_json(self) -> dict:
        return {f: getattr(self, f) for f in REWRITE_FIELDS}


@dataclass(frozen=True)
class Rewrites:
    pipeline: tuple[str, ...]  # the rewrites run, in order; empty for an unfused package
    results: dict[str, dict[str, RewriteResult]]  # pass -> rewrite -> result

    def to_json(self) -> dict:
        return {"pipeline": list(self.pipeline),
                "results": {p: {r: res.to_json() for r, res in by.items()} for p, by in self.results.items()}}

    @classmethod
    def from_json(cls, data) -> "Rewrites":
        _expect(isinstance(data, dict), "rewrites", data, "an object")
        _keys(data, "rewrites", ("pipeline", "results"))
        pipeline, results = data["pipeline"], data["results"]
        _expect(isinstance(pipeline, list) and all(isinstance(n, str) for n in pipeline), "rewrites.pipeline",
                pipeline, "a list of rewrite names")
        _expect(isinstance(results, dict) and all(isinstance(v, dict) for v in results.values()),
                "rewrites.results", results, "an object of pass -> rewrite -> result")
        typed = {}
        for pass_name, by_rewrite in results.items():
            typed[pass_name] = {}
            for rewrite, result in by_rewrite.items():
                field = f"rewrites.results.{pass_name}.{rewrite}"
                _expect(isinstance(result, dict), field, result, "an object")
                _keys(result, field, REWRITE_FIELDS)
                for name in REWRITE_FIELDS:
                    _expect(_count(result[name]) and result[name] >= 0, f"{field}.{name}", result[name],
                            "a non-negative integer")
                typed[pass_name][rewrite] = RewriteResult(**result)
        return cls(tuple(pipeline), typed)


@dataclass(frozen=True)
class WeightTensor:
    """A tensor a structural package needs from a checkpoint (weight_binding.py)."""

    dtype: str
    shape: tuple[int, ...]
    sha256: str | None = None  # recorded when the exporter was given a checkpoint index

    def to_json(self) -> dict:
        out = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out


@dataclass(frozen=True)
class Weights:
    """Where the weights come from: a file of the package (`file`; None in a parallel package,
    whose ranks name theirs) or, `external`, a checkpoint holding `tensors`."""

    source: str
    file: str | None = None
    external: bool = False
    tensors: dict[str, WeightTensor] | None = None

    def to_json(self) -> dict:
        if self.external:
            return {"external": True, "source": self.source,
                    "tensors": {n: t.to_json() for n, t in self.tensors.items()}}
        return {"file": self.file, "source": self.source}

    @classmethod
    def from_json(cls, data) -> "Weights":
        if not isinstance(data, dict):
            raise PackageError(f"{WHERE}: 'weights' is missing or not an object")
        external = data.get("external", False)
        _expect(isinstance(external, bool), "weights.external", external, "a boolean")
        _expect(isinstance(data.get("source"), str), "weights.source", data.get("source"), "a string")
        if not external:
            _keys(data, "weights", ("file", "source"), ("external",))
            _expect(data["file"] is None or isinstance(data["file"], str), "weights.file", data["file"],
                    "a file name or null")
            return cls(data["source"], data["file"])
        _keys(data, "weights", ("external", "source"), ("tensors",))
        tensors = data.get("tensors")
        if not isinstance(tensors, dict):
            raise PackageError(f"{WHERE}: weights are external but 'weights.tensors' is missing")
        return cls(data["source"], None, True, {n: _weight_tensor(n, t) for n, t in tensors.items()})


def _weight_tensor(name: str, data) -> WeightTensor:
    field = f"weights.tensors.{name}"
    _expect(isinstance(data, dict), field, data, "an object")
    _keys(data, field, ("dtype", "shape"), ("sha256",))
    shape, checksum = data["shape"], data.get("sha256")
    _expect(isinstance(data["dtype"], str), f"{field}.dtype", data["dtype"], "a dtype name")
    _expect(isinstance(shape, list) and all(_count(s) and s >= 0 for s in shape), f"{field}.shape", shape,
            "a list of sizes")
    _expect(checksum is None or isinstance(checksum, str), f"{field}.sha256", checksum, "a hex digest")
    return WeightTensor(data["dtype"], tuple(shape), checksum)


# -- the manifest ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    format_version: str
    opset_version: int
    name: str
    recipe: dict  # the normalised recipe, as the exporter's schema writes it (opaque to the runtime)
    recipe_sha256: str
    model: ModelFacts
    passes: dict[str, PassEntry]
    buffers: dict[str, BufferInfo]  # what every cache and staging buffer is, by name
    cache_formats: dict[str, str]  # format name -> whose bytes it holds (cache_formats.py)
    abi_fingerprint: str
    rewrites: Rewrites
    weights: Weights
    versions: dict[str, str]  # tool and kernel-library versions
    files: dict[str, str] = dataclasses.field(default_factory=dict)  # every other file -> its sha256
    parallel: Mapping | None = None
    manifest_sha256: str | None = None  # None until written: the digest of the rest

    def to_json(self) -> dict:
        """The JSON document, digest included when set (the writer sets it: `signed`)."""
        out = {
            "format_version": self.format_version,
            "opset_version": self.opset_version,
            "name": self.name,
            "recipe": self.recipe,
            "recipe_sha256": self.recipe_sha256,
            "model": self.model.to_json(),
            "passes": {n: p.to_json() for n, p in self.passes.items()},
            "buffers": {n: b.to_json() for n, b in self.buffers.items()},
            "cache_formats": dict(self.cache_formats),
            "abi_fingerprint": self.abi_fingerprint,
            "rewrites": self.rewrites.to_json(),
            "weights": self.weights.to_json(),
            "versions": dict(self.versions),
            "files": dict(self.files),
        }
        if self.parallel is not None:
            out["parallel"] = self.parallel.to_json()
        if self.manifest_sha256 is not None:
            out["manifest_sha256"] = self.manifest_sha256
        return out

    def signed(self, files: dict[str, str]) -> "Manifest":
        """This manifest listing `files` (name -> sha256), with the digest of its JSON."""
        unsigned = dataclasses.replace(self, files=dict(sorted(files.items())), manifest_sha256=None)
        return dataclasses.replace(unsigned, manifest_sha256=digest(unsigned.to_json()))

    def to_bytes(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data) -> "Manifest":
        """The checked, typed manifest of a JSON document (see the module's docstring)."""
        if not isinstance(data, dict):
            raise PackageError(f"{WHERE}: top level is not an object")
        check_versions(data)
        if data.get("manifest_sha256") != digest(data):
            raise PackageError(f"{WHERE}: manifest_sha256 does not match its contents (corrupted or edited)")
        passes_json = _check_fingerprint(data)
        passes, buffers = read_passes(passes_json, data.get("buffers"))
        shared_buffers(passes)  # the passes bind each shared buffer alike (Package.buffers is that table)
        check_cache_formats(data.get("cache_formats"), buffers)
        parallel = None if data.get("parallel") is None else Mapping.from_json(data["parallel"], passes)
        for field in ("name", "recipe_sha256"):
            _expect(isinstance(data.get(field), str) and data[field], field, data.get(field), "a non-empty string")
        _expect(isinstance(data.get("recipe"), dict), "recipe", data.get("recipe"), "an object")
        _expect(_str_map(data.get("versions")), "versions", data.get("versions"), "an object of version strings")
        files = data.get("files")
        if not (_str_map(files) and files):
            raise PackageError(f"{WHERE}: 'files' is missing or empty")
        model, rewrites = ModelFacts.from_json(data.get("model")), Rewrites.from_json(data.get("rewrites"))
        weights = Weights.from_json(data.get("weights"))
        _keys(data, "top level", FIELDS, OPTIONAL)  # only unknown fields are left to find
        return cls(data["format_version"], data["opset_version"], data["name"], data["recipe"],
                       data["recipe_sha256"], model, passes, buffers, dict(data["cache_formats"]),
                       data["abi_fingerprint"], rewrites, weights, dict(data["versions"]), dict(files), parallel,
                       data["manifest_sha256"])


# -- the checks before typing ------------------------------------------------------------------


def _major_minor(text) -> tuple[int, int]:
    try:
        major, minor = (int(x) for x in str(text).split("."))
        return major, minor
    except ValueError:
        raise PackageError(f"{WHERE}: format_version {text!r} is not of the form MAJOR.MINOR") from None


def _recipe_hint(data: dict) -> str:
    name = data.get("name")
    return REEXPORT.replace("RECIPE", name) if isinstance(name, str) and name.isprintable() and name else REEXPORT


def check_versions(data: dict) -> None:
    major, minor = _major_minor(data.get("format_version"))
    ours = _major_minor(FORMAT_VERSION)
    if major < ours[0]:
        raise PackageError(f"{WHERE}: format_version {major}.{minor} is older than this runtime reads "
                           f"({ours[0]}.0 to {ours[0]}.{ours[1]}); {_recipe_hint(data)}")
    if major != ours[0] or minor > ours[1]:
        raise PackageError(
            f"{WHERE}: format_version {major}.{minor} is not supported by this runtime "
            f"(reads {ours[0]}.0 to {ours[0]}.{ours[1]}); it needs a newer b12x"
        )
    found = data.get("opset_version")
    if found != OPSET_VERSION:
        older = _count(found) and 1 <= found < OPSET_VERSION
        advice = _recipe_hint(data) if older else "it is not an op set this runtime knows"
        raise PackageError(f"{WHERE}: opset_version {found!r} is unknown; this runtime has op set "
                           f"{OPSET_VERSION}: {advice}")


def _check_fingerprint(data: dict) -> dict:
    """Over the JSON as written, before typing: a convention edited without signing it again
    is refused as such, whatever else is wrong with it."""
    passes_json = data.get("passes")
    if not isinstance(passes_json, dict) or not passes_json:
        raise PackageError(f"{WHERE}: 'passes' is missing or empty")
    if fingerprint(contract(passes_json, data.get("buffers"), data.get("cache_formats"))) \
            != data.get("abi_fingerprint"):
        raise PackageError(f"{WHERE}: abi_fingerprint does not match the calling conventions")
    return passes_json
