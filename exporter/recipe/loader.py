"""Export recipes, version 1: the schema, the loader and located errors.

A recipe fixes everything an export depends on besides the weights: model shape,
cache formats, the passes to capture with their row buckets, and the graph rewrites
expected to fire.  Its normalized form has a stable hash, so an exported artifact
can record exactly which recipe produced it.

Every problem is reported as one ``RecipeError`` that names file, line and key path,
e.g. ``dsv41.yaml:23: passes.verify.width: Input should be greater than 0``.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BeforeValidator, Field, Strict, ValidationError, model_validator

from b12x_toolchain.exporter.model.weight_layout import check_weight_layout
from b12x_toolchain.exporter.recipe.field_types import (
    Buckets,
    NonNegInt,
    PosInt,
    _check,
    _no_bool,
    _problem,
    _Spec,
    format_key_path,
)
from b12x_toolchain.exporter.recipe.parallel import ParallelSpec
from b12x_toolchain.exporter.recipe.schema import V4ModelSpec, V41ModelSpec
from b12x_toolchain.exporter.recipe.weights import WeightsSpec
from b12x_toolchain.exporter.recipe.yaml_source import MAX_DOCUMENT_BYTES, Lines, YamlSourceError, load_yaml
from b12x_toolchain.passes.pipeline import REWRITES
from b12x_toolchain.runtime.formats.codecs import renamed
from b12x_toolchain.runtime.ops.qualify import QUALIFIED_HISTORY, QUALIFIED_LAYOUTS, QUALIFIED_PAGE_SIZES

__all__ = [
    "KNOWN_REWRITES", "PASS_NAMES", "Recipe", "RecipeError",
    "bundled_fallback", "bundled_recipes", "load_recipe", "parse_recipe",
]

KNOWN_REWRITES = tuple(REWRITES)  # from the registry: a recipe names exactly the rewrites there are
PASS_NAMES = ("prefill", "verify", "draft", "commit")  # every recipe has these
OPTIONAL_PASSES = ("decode",)  # and may add these
FAMILIES = ("deepseek_v41", "deepseek_v4")
PassName = Literal["prefill", "decode", "verify", "draft", "commit"]


class RecipeError(ValueError):
    """One recipe problem, located as precisely as the source allows."""

    def __init__(self, file: str, line: int | None, key_path: str, message: str):
        self.file, self.line, self.key_path, self.message = file, line, key_path, message
        where = file if line is None else f"{file}:{line}"
        super().__init__(f"{where}: {key_path}: {message}" if key_path else f"{where}: {message}")

    def __reduce__(self):  # keep the error picklable across worker processes
        return type(self), (self.file, self.line, self.key_path, self.message)


class StagingSpec(_Spec):
    layout: Literal["NHD", "HND"]
    page_size: Annotated[PosInt, _check(lambda v: v & (v - 1) == 0, "a power of two")]


class PagesSpec(_Spec):
    """Tokens per page of each paged cache kind. A page holds tokens_per_page / ratio
    entries of every layer owning that kind; all layers share one block table per kind."""

    compressed_entries: PosInt = 256
    index_keys: PosInt = 256


def _renamed_format(value):
    """A format name from before the V4.1 records gets what replaced it, at its line."""
    if renamed(value):
        raise ValueError(f"format {renamed(value)}")
    return value


def _formats(*names):
    return Annotated[Literal[names], BeforeValidator(_renamed_format)]


class CacheSpec(_Spec):
    history: PosInt
    window_format: _formats("dsv41_mxfp8", "ocp_mxfp8", "bf16", "fp32")
    compressed_format: _formats("dsv41_nvfp4", "dsv41_mxfp8", "ocp_mxfp8", "bf16", "fp32")
    state_format: Literal["fp32"]
    index_format: _formats("dsv41_mxfp4", "ocp_mxfp4", "ocp_mxfp8", "dsv41_mxfp8", "bf16", "fp32") = "fp32"  # indexer keys
    staging: StagingSpec
    pages: PagesSpec = PagesSpec()


class PrefillPass(_Spec):
    chunk: PosInt
    rows_buckets: Buckets


class WidthPass(_Spec):
    """verify or draft: ``width`` tokens per row, captured once per rows bucket."""

    width: PosInt
    rows_buckets: Buckets


class CommitPass(_Spec):
    rows_buckets: Buckets


class DecodePass(_Spec):
    """One token per row, written straight into the caches: greedy or sampled decoding
    without a drafter, which would otherwise pay for a whole verify block and a commit."""

    rows_buckets: Buckets


class Passes(_Spec):
    prefill: PrefillPass
    verify: WidthPass
    draft: WidthPass
    commit: CommitPass
    decode: Optional[DecodePass] = None

    @model_validator(mode="after")
    def _widths(self) -> Passes:
        # The drafter proposes one token fewer than verify checks: verify also scores
        # the last accepted token.
        if self.draft.width != self.verify.width - 1:
            raise _problem(f"{self.draft.width} does not match verify.width - 1 = {self.verify.width - 1}",
                           ("draft", "width"))
        return self


def _known_rewrite(name: str) -> str:
    if name not in KNOWN_REWRITES:
        raise _problem(f"unknown rewrite {name!r}; known rewrites: {', '.join(KNOWN_REWRITES)}")
    return name


def _all_passes(counts: dict[str, int]) -> dict[str, int]:
    missing = [p for p in PASS_NAMES if p not in counts]
    if missing:
        raise _problem(f"missing {', '.join(missing)}; expected a key for every pass of the recipe "
                       f"({', '.join(PASS_NAMES)}, and {' or '.join(OPTIONAL_PASSES)} where it has one)")
    return counts


class RewriteSpec(_Spec):
    name: Annotated[str, Strict(), AfterValidator(_known_rewrite)]
    # How often the rewrite is expected to match in each pass graph.
    expect_matches: Annotated[dict[PassName, NonNegInt], AfterValidator(_all_passes)]


class Recipe(_Spec):
    recipe_version: Annotated[Literal[1], BeforeValidator(_no_bool)]
    name: Annotated[str, Strict(), Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")]
    model: Annotated[V41ModelSpec | V4ModelSpec, Field(discriminator="family")]
    cache: CacheSpec
    passes: Passes
    rewrites: tuple[RewriteSpec, ...] = ()
    parallel: ParallelSpec | None = None  # None: one device
    weights: WeightsSpec | None = None  # None: every weight fp32

    @property
    def pass_names(self) -> tuple[str, ...]:
        """The passes this recipe exports, in export order: the four, then the optional ones it declares."""
        return PASS_NAMES + tuple(p for p in OPTIONAL_PASSES if getattr(self.passes, p) is not None)

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        # A query sees itself plus window - 1 earlier rows, all of which the cache keeps.
        if self.cache.history < self.model.window - 1:
            raise _problem(f"{self.cache.history} is shorter than model.window - 1 = {self.model.window - 1}",
                           ("cache", "history"))
        # A prefill chunk must fit in the history the cache keeps.
        if self.passes.prefill.chunk > self.cache.history:
            raise _problem(f"{self.passes.prefill.chunk} is larger than cache.history = {self.cache.history}",
                           ("passes", "prefill", "chunk"))
        self._check_pages()
        if self.parallel is not None:
            self.parallel.check(self.model)
        if self.weights is not None:
            check_weight_layout(self)
        for i, rewrite in enumerate(self.rewrites):
            if any(r.name == rewrite.name for r in self.rewrites[:i]):
                raise _problem(f"rewrite {rewrite.name!r} is listed twice", ("rewrites", i, "name"))
            keys = set(rewrite.expect_matches)
            if keys != set(self.pass_names):
                wrong = sorted(keys - set(self.pass_names)) or sorted(set(self.pass_names) - keys)
                what = "is not a pass of this recipe" if keys - set(self.pass_names) else "is missing"
                raise _problem(f"{wrong[0]} {what}; expected exactly the keys {', '.join(self.pass_names)}",
                               ("rewrites", i, "expect_matches"))
            if rewrite.name == "fuse_window_snapshot":
                self._check_window_fusion(i, rewrite)
        return self

    def _check_pages(self) -> None:
        """A page holds whole entries of every compressed layer, and no more than a slot's tokens."""
        ratios = sorted(set(self.model.target_ratios) - {0})
        for kind in PagesSpec.model_fields:
            tokens = getattr(self.cache.pages, kind)
            for ratio in ratios:
                if tokens % ratio:
                    raise _problem(f"{tokens} tokens per page is not a multiple of compress ratio {ratio}; "
                                   "a page must hold whole entries", ("cache", "pages", kind))
            if tokens > self.model.max_seq_len:
                raise _problem(f"{tokens} tokens per page is more than model.max_seq_len = {self.model.max_seq_len}",
                               ("cache", "pages", kind))

    def _check_window_fusion(self, index: int, rewrite: RewriteSpec) -> None:
        """Refuse at the recipe's own line what export would refuse after minutes of capture."""
        staging = self.cache.staging
        for key, value, qualified in (
            (("cache", "history"), self.cache.history, QUALIFIED_HISTORY),
            (("cache", "staging", "layout"), staging.layout, QUALIFIED_LAYOUTS),
            (("cache", "staging", "page_size"), staging.page_size, QUALIFIED_PAGE_SIZES),
        ):
            if value not in qualified:
                raise _problem(f"{value!r} is not supported by the fused window snapshot append "
                               f"(qualified: {', '.join(map(str, qualified))}); drop fuse_window_snapshot "
                               f"from rewrites to export unfused", key)
        # Sites: one snapshot per target layer in verify, per draft stage in draft, none elsewhere.
        # MTP drafts one token at a time and reads its window without appending a block.
        draft_sites = 0 if self.model.family == "deepseek_v4" else self.model.draft.stages
        sites = {"prefill": 0, "decode": 0, "verify": self.model.num_layers, "draft": draft_sites, "commit": 0}
        for pass_name, expected in rewrite.expect_matches.items():
            if expected > sites[pass_name]:
                raise _problem(f"{expected} matches are impossible: the {pass_name} graph has {sites[pass_name]} "
                               f"window snapshot sites", ("rewrites", index, "expect_matches", pass_name))

    def normalized(self) -> dict[str, Any]:
        """All fields, defaults filled, as plain JSON data with keys sorted recursively.

        An optional pass the recipe does not declare is left out rather than written as
        null, so a recipe without one keeps the digest it had before such passes existed.
        """
        data = self.model_dump(mode="json")
        for name in OPTIONAL_PASSES:
            if data["passes"].get(name) is None:
                data["passes"].pop(name, None)
        for section in ("parallel", "weights"):  # likewise a recipe for one device, or all in fp32
            if data.get(section) is None:
                data.pop(section, None)
        if data["model"].get("engram", 0) is None:  # and a model without Engram layers
            data["model"].pop("engram")
        return _sort_keys(data)

    def sha256(self) -> str:
        text = json.dumps(self.normalized(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _sort_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sort_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sort_keys(item) for item in value]
    return value


# --- loading ------------------------------------------------------------------------

def _locate(error: dict[str, Any], lines: Lines, file: str) -> RecipeError:
    """Turn pydantic's first error into a RecipeError at the deepest line we know."""
    # "[key]" marks a bad dict key; a family tag is pydantic's, not a key of the file.
    path = tuple(p for p in error["loc"] if p != "[key]" and p not in FAMILIES)
    ctx = error.get("ctx") or {}
    message = error["msg"]
    if error["type"] == "recipe_check":
        path += tuple(ctx["path"])
        message = ctx["detail"]
    elif error["type"] in ("union_tag_invalid", "union_tag_not_found"):
        path += ("family",)
        message = f"expected one of {', '.join(FAMILIES)}" + (
            f", got {ctx['tag']!r}" if "tag" in ctx else "; the key is missing")
    elif error["type"] == "extra_forbidden":
        message = f"unknown key {path[-1]!r}; it is not part of recipe version 1"
    # A missing key has no line of its own, so this falls back to its parent mapping.
    prefix = path
    while prefix not in lines:
        prefix = prefix[:-1]
    return RecipeError(file, lines[prefix], format_key_path(path), message)


def parse_recipe(text: str | bytes, file: str = "<string>") -> Recipe:
    """Parse and validate recipe text; ``file`` is only used in error messages."""
    if isinstance(text, bytes):
        text = _decode(text, file)
    try:
        data, lines = load_yaml(text)
    except YamlSourceError as exc:
        raise RecipeError(file, exc.line, format_key_path(exc.path), exc.message) from None
    if not isinstance(data, dict):
        raise RecipeError(file, lines[()], "", f"top level is a {type(data).__name__}; expected a mapping")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise _locate(exc.errors()[0], lines, file) from None


def _decode(data: bytes, file: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise RecipeError(file, line, "", f"not valid UTF-8 (byte {exc.start})") from None


def bundled_recipes() -> list[str]:
    """Names of the recipes shipped with b12x, usable with ``load_recipe(name)``."""
    return sorted(p.name[: -len(".yaml")] for p in files("b12x_toolchain.recipes").iterdir() if p.name.endswith(".yaml"))


def bundled_fallback(source: str | os.PathLike[str]) -> str | None:
    """The bundled recipe a missing ``NAME.yaml`` (or ``NAME.yml``) stands for, else None.

    ``b12x export --recipe dsv41.yaml`` is how the project card spells it; on a fresh
    install no such file is in the working directory and the user means the bundled
    recipe. An existing file always wins, and ``load_recipe`` itself stays literal: the
    caller decides to substitute the name and says so.
    """
    text = os.fspath(source)
    if os.path.lexists(text):
        return None
    for suffix in (".yaml", ".yml"):
        if text.endswith(suffix) and text[: -len(suffix)] in bundled_recipes():
            return text[: -len(suffix)]
    return None


def _is_path(source: str) -> bool:
    return (
        os.path.exists(source)
        or os.sep in source
        or (os.altsep is not None and os.altsep in source)
        or source.endswith((".yaml", ".yml"))
    )


def load_recipe(source: str | os.PathLike[str]) -> Recipe:
    """Load a recipe from a file path or by bundled name (``dsv41``, ``dsv41-tiny``)."""
    if isinstance(source, os.PathLike) or _is_path(source):
        label = os.fspath(source)
        return parse_recipe(_read_file(Path(label), label), label)
    names = bundled_recipes()
    if source not in names:
        raise RecipeError(source, None, "", f"no such recipe file or bundled recipe {source!r};"
                          f" bundled recipes: {', '.join(names)}")
    label = f"{source}.yaml"
    return parse_recipe((files("b12x_toolchain.recipes") / label).read_bytes(), label)


def _read_file(path: Path, label: str) -> bytes:
    try:
        if not path.is_file():
            if path.exists():
                raise RecipeError(label, None, "", f"recipe file {label} is not a regular file")
            raise RecipeError(label, None, "", "recipe file does not exist; expected a YAML path or a bundled"
                              f" recipe name: {', '.join(bundled_recipes())}")
        # Check the size before reading so a huge file is never loaded into memory.
        size = path.stat().st_size
        if size > MAX_DOCUMENT_BYTES:
            raise RecipeError(label, None, "", f"document is {size} bytes; the limit is"
                              f" {MAX_DOCUMENT_BYTES} bytes (1 MiB)")
        return path.read_bytes()
    except OSError as exc:
        raise RecipeError(label, None, "", f"cannot read recipe file {label}: {exc.strerror or exc}") from None
