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
import json
from dataclasses import dataclass

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.ops.opset import OPSET_VERSION
from b12x_toolchain.runtime.package.abi import contract, fingerprint
from b12x_toolchain.runtime.package.cache_formats import check_cache_formats
from b12x_toolchain.runtime.package.contract import BufferInfo
from b12x_toolchain.runtime.package.conventions import PassEntry, read_passes, shared_buffers
from b12x_toolchain.runtime.package.manifest_digest import digest, digest_holds
from b12x_toolchain.runtime.package.manifest_sections import (  # noqa: F401
    WHERE,
    ModelFacts,
    RewriteResult,
    Rewrites,
    TokenizerFacts,
    Weights,
    WeightTensor,  # (re-exported: the sections)
    check_engram_tables,
    check_weight_formats,
    expect,
    expect_keys,
    is_count,
    is_str_map,
)
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
# a package for one device is still written as 4.0. 4.2 adds weights stored in formats
# (`weights.formats`, `weights.activation`: runtime/formats/weight_formats.py), with op set
# 5's quantized linears; a package without them is still written as 4.0 or 4.1. 4.3 adds
# Engram: the token_history cache and staging kinds, op set 6's engram_hash and engram_lookup,
# the tables listed (`weights.engram_tables`) and, under tensor parallelism, split by hash head
# (a split's `ranges`: runtime/parallel/mapping.py); a package without Engram is written as before.
# 4.4 adds the tokenizer a package may carry (`tokenizer`: its files, eos and pad ids, chat
# template or not); a package without one is written as before.
FORMAT_VERSION = "4.4"
REEXPORT = "re-export it with this version of b12x (b12x export --recipe RECIPE)"

FIELDS = ("format_version", "opset_version", "name", "recipe", "recipe_sha256", "model", "passes", "buffers",
          "cache_formats", "abi_fingerprint", "rewrites", "weights", "versions", "files", "manifest_sha256")
OPTIONAL = ("parallel", "tokenizer")  # a package for one device has no parallel; one without text no tokenizer


def abi_fingerprint(passes: dict[str, PassEntry], buffers: dict[str, BufferInfo], cache_formats: dict,
                    weights: Weights | None = None) -> str:
    """The ABI fingerprint of typed conventions (abi.py): what the writer records."""
    formats = None if weights is None else weights.to_json().get("formats")
    return fingerprint(contract({n: p.to_json() for n, p in passes.items()},
                                {n: b.to_json() for n, b in buffers.items()}, cache_formats, formats))


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
    tokenizer: TokenizerFacts | None = None
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
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer.to_json()
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
        if not digest_holds(data):
            raise PackageError(f"{WHERE}: manifest_sha256 does not match its contents (corrupted or edited)")
        passes_json = _check_fingerprint(data)
        passes, buffers = read_passes(passes_json, data.get("buffers"))
        shared_buffers(passes)  # the passes bind each shared buffer alike (Package.buffers is that table)
        check_cache_formats(data.get("cache_formats"), buffers)
        parallel = None if data.get("parallel") is None else Mapping.from_json(data["parallel"], passes)
        for field in ("name", "recipe_sha256"):
            expect(isinstance(data.get(field), str) and data[field], field, data.get(field), "a non-empty string")
        expect(isinstance(data.get("recipe"), dict), "recipe", data.get("recipe"), "an object")
        expect(is_str_map(data.get("versions")), "versions", data.get("versions"), "an object of version strings")
        files = data.get("files")
        if not (is_str_map(files) and files):
            raise PackageError(f"{WHERE}: 'files' is missing or empty")
        model, rewrites = ModelFacts.from_json(data.get("model")), Rewrites.from_json(data.get("rewrites"))
        weights = Weights.from_json(data.get("weights"))
        weight_dtypes = {s.name: s.dtype for p in passes.values() for s in p.inputs if s.role == "weight"}
        check_weight_formats(weights.formats, weight_dtypes)
        check_engram_tables(weights.engram_tables, weight_dtypes)
        tokenizer = None if "tokenizer" not in data else \
            TokenizerFacts.from_json(data["tokenizer"], files, model.vocab_size)
        expect_keys(data, "top level", FIELDS, OPTIONAL)  # only unknown fields are left to find
        return cls(data["format_version"], data["opset_version"], data["name"], data["recipe"],
                       data["recipe_sha256"], model, passes, buffers, dict(data["cache_formats"]),
                       data["abi_fingerprint"], rewrites, weights, dict(data["versions"]), dict(files), parallel,
                       tokenizer, data["manifest_sha256"])


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
        older = is_count(found) and 1 <= found < OPSET_VERSION
        advice = _recipe_hint(data) if older else "it is not an op set this runtime knows"
        raise PackageError(f"{WHERE}: opset_version {found!r} is unknown; this runtime has op set "
                           f"{OPSET_VERSION}: {advice}")


def _check_fingerprint(data: dict) -> dict:
    """Over the JSON as written, before typing: a convention edited without signing it again
    is refused as such, whatever else is wrong with it."""
    passes_json = data.get("passes")
    if not isinstance(passes_json, dict) or not passes_json:
        raise PackageError(f"{WHERE}: 'passes' is missing or empty")
    weights = data.get("weights")
    formats = weights.get("formats") if isinstance(weights, dict) else None
    if fingerprint(contract(passes_json, data.get("buffers"), data.get("cache_formats"), formats)) \
            != data.get("abi_fingerprint"):
        raise PackageError(f"{WHERE}: abi_fingerprint does not match the calling conventions")
    return passes_json
