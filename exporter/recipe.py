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
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict
from pydantic import ValidationError, model_validator
from pydantic_core import PydanticCustomError

from b12x.runtime.qualify import QUALIFIED_HISTORY, QUALIFIED_LAYOUTS, QUALIFIED_PAGE_SIZES
from b12x.exporter.yaml_source import MAX_DOCUMENT_BYTES, Lines, YamlSourceError, load_yaml

__all__ = [
    "KNOWN_REWRITES", "PASS_NAMES", "Recipe", "RecipeError",
    "bundled_recipes", "load_recipe", "parse_recipe",
]

KNOWN_REWRITES = ("fuse_window_snapshot",)
PASS_NAMES = ("prefill", "verify", "draft", "commit")
FAMILIES = ("deepseek_v41", "deepseek_v4")
PassName = Literal["prefill", "verify", "draft", "commit"]
KeyPath = tuple[str | int, ...]


class RecipeError(ValueError):
    """One recipe problem, located as precisely as the source allows."""

    def __init__(self, file: str, line: int | None, key_path: str, message: str):
        self.file, self.line, self.key_path, self.message = file, line, key_path, message
        where = file if line is None else f"{file}:{line}"
        super().__init__(f"{where}: {key_path}: {message}" if key_path else f"{where}: {message}")

    def __reduce__(self):  # keep the error picklable across worker processes
        return type(self), (self.file, self.line, self.key_path, self.message)


def format_key_path(path: KeyPath) -> str:
    """``("model", "compress_ratios", 3)`` -> ``model.compress_ratios[3]``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _problem(detail: str, path: KeyPath = ()) -> PydanticCustomError:
    """A validation error whose ``path`` (relative to where pydantic raises it) points
    at the offending key, so a check spanning several fields still names one line."""
    where = format_key_path(path)
    template = "{where}: {detail}" if where else "{detail}"
    return PydanticCustomError("recipe_check", template, {"where": where, "detail": detail, "path": path})


# --- field types --------------------------------------------------------------------

def _no_bool(value: Any) -> Any:
    # True == 1 in Python, so Literal[1] and Literal[0, 1, 2] would accept booleans.
    if isinstance(value, bool):
        raise _problem(f"expected a number, got the boolean {value}")
    return value


def _check(predicate, expected: str):
    def validate(value):
        if not predicate(value):
            raise _problem(f"{value!r} is not {expected}")
        return value
    return AfterValidator(validate)


def _strictly_increasing(values: tuple[int, ...]) -> tuple[int, ...]:
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            raise _problem(f"{values[i]} follows {values[i - 1]}; buckets must be strictly increasing", (i,))
    return values


def _unique(values: tuple[int, ...]) -> tuple[int, ...]:
    for i, value in enumerate(values):
        if value in values[:i]:
            raise _problem(f"{value} is listed twice; entries must be unique", (i,))
    return values


PosInt = Annotated[int, Strict(), Field(gt=0)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
PosFloat = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
Ratio = Annotated[Literal[0, 1, 2], BeforeValidator(_no_bool)]
Buckets = Annotated[tuple[PosInt, ...], Field(min_length=1), AfterValidator(_strictly_increasing)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- schema -------------------------------------------------------------------------

class DraftSpec(_Spec):
    stages: PosInt
    target_layer_ids: Annotated[tuple[NonNegInt, ...], Field(min_length=1), AfterValidator(_unique)]
    noise_token_id: NonNegInt


class ModelSpec(_Spec):
    family: Literal["deepseek_v41"]
    vocab_size: PosInt
    hidden_size: PosInt
    num_layers: PosInt
    num_heads: PosInt
    # Cache rows are quantized in 32-element blocks (MXFP8 / NVFP4 scale groups).
    head_dim: Annotated[PosInt, _check(lambda v: v % 32 == 0, "a multiple of 32")]
    rope_head_dim: Annotated[PosInt, _check(lambda v: v % 2 == 0, "even (RoPE rotates pairs)")]
    intermediate_size: PosInt
    compress_ratios: tuple[Ratio, ...]
    window: PosInt
    max_seq_len: PosInt
    rms_norm_eps: PosFloat
    rope_theta: PosFloat
    compress_rope_theta: PosFloat
    draft: DraftSpec
    init_seed: NonNegInt

    @property
    def target_ratios(self) -> tuple[int, ...]:
        """Compression ratio of each target layer (the draft stages' entries dropped)."""
        return self.compress_ratios[: self.num_layers]

    @model_validator(mode="after")
    def _cross_checks(self) -> ModelSpec:
        if self.rope_head_dim > self.head_dim:
            raise _problem(f"{self.rope_head_dim} is larger than head_dim {self.head_dim}", ("rope_head_dim",))
        expected = self.num_layers + self.draft.stages
        if len(self.compress_ratios) != expected:
            raise _problem(f"has {len(self.compress_ratios)} entries; expected num_layers + draft.stages"
                           f" = {expected}", ("compress_ratios",))
        for i in range(self.num_layers, expected):
            if self.compress_ratios[i] != 0:
                raise _problem(f"draft stage entry is {self.compress_ratios[i]}; draft stages use the window"
                               " only, so it must be 0", ("compress_ratios", i))
        for i, layer in enumerate(self.draft.target_layer_ids):
            if layer >= self.num_layers:
                raise _problem(f"layer {layer} is out of range; expected 0 <= id < num_layers"
                               f" = {self.num_layers}", ("draft", "target_layer_ids", i))
        if self.draft.noise_token_id >= self.vocab_size:
            raise _problem(f"{self.draft.noise_token_id} is out of range; expected < vocab_size"
                           f" = {self.vocab_size}", ("draft", "noise_token_id"))
        for ratio in sorted(set(self.compress_ratios) - {0}):
            if self.max_seq_len % ratio:
                raise _problem(f"{self.max_seq_len} is not a multiple of compress ratio {ratio}", ("max_seq_len",))
        return self


class YarnSpec(_Spec):
    """YaRN scaling of the compress RoPE (DeepSeek V4: factor 16; cos/sin are not rescaled)."""

    factor: PosFloat
    original_max_position_embeddings: PosInt
    beta_fast: PosFloat = 32.0
    beta_slow: PosFloat = 1.0


class IndexerSpec(_Spec):
    """The lightning indexer of CSA layers: scores compressed entries, keeps the top `topk`."""

    heads: PosInt
    head_dim: Annotated[PosInt, _check(lambda v: v % 2 == 0, "even (RoPE rotates pairs)")]
    topk: PosInt


class HyperConnectionSpec(_Spec):
    """Manifold-constrained hyper-connections: `mult` residual streams, Sinkhorn-projected mixing."""

    mult: PosInt
    sinkhorn_iters: PosInt
    eps: PosFloat


class MoeSpec(_Spec):
    experts: PosInt
    experts_per_token: PosInt
    shared_experts: Annotated[int, Strict(), Field(ge=0, le=1)]
    intermediate_size: PosInt
    hash_layers: NonNegInt  # the first `hash_layers` layers route by a token-id table
    scoring: Literal["sqrtsoftplus", "sigmoid", "softmax"]
    routed_scaling_factor: PosFloat
    swiglu_limit: PosFloat


class MtpSpec(_Spec):
    """Multi-token prediction draft stages: each a window-only V4 block fed with the target's
    streams and the next token's embedding; drafts are chained one token at a time."""

    stages: Annotated[int, Strict(), Literal[1]]


CompressRatioV4 = Annotated[int, Strict(), Field(ge=0)]


class V4ModelSpec(_Spec):
    """DeepSeek V4 as Hugging Face `transformers` implements it (DeepseekV4ForCausalLM)."""

    family: Literal["deepseek_v4"]
    vocab_size: PosInt
    hidden_size: PosInt
    num_layers: PosInt
    num_heads: PosInt
    head_dim: Annotated[PosInt, _check(lambda v: v % 32 == 0, "a multiple of 32")]
    rope_head_dim: Annotated[PosInt, _check(lambda v: v % 2 == 0, "even (RoPE rotates pairs)")]
    q_lora_rank: PosInt
    o_groups: PosInt
    o_lora_rank: PosInt
    # Per target layer, then per MTP stage: 0 window only, csa_ratio (CSA), hca_ratio (HCA).
    compress_ratios: tuple[CompressRatioV4, ...]
    csa_ratio: PosInt
    hca_ratio: PosInt
    window: PosInt
    max_seq_len: PosInt
    rms_norm_eps: PosFloat
    rope_theta: PosFloat
    compress_rope_theta: PosFloat
    yarn: YarnSpec | None = None
    indexer: IndexerSpec
    hyper_connections: HyperConnectionSpec
    moe: MoeSpec
    draft: MtpSpec
    init_seed: NonNegInt

    @property
    def target_ratios(self) -> tuple[int, ...]:
        return self.compress_ratios[: self.num_layers]

    @model_validator(mode="after")
    def _cross_checks(self) -> V4ModelSpec:
        if self.rope_head_dim > self.head_dim:
            raise _problem(f"{self.rope_head_dim} is larger than head_dim {self.head_dim}", ("rope_head_dim",))
        if self.rope_head_dim > self.indexer.head_dim:
            raise _problem(f"{self.indexer.head_dim} is smaller than rope_head_dim {self.rope_head_dim}",
                           ("indexer", "head_dim"))
        if self.csa_ratio == self.hca_ratio:
            raise _problem(f"{self.hca_ratio} equals csa_ratio; the two compressed layer kinds need distinct "
                           "ratios", ("hca_ratio",))
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise _problem(f"{self.o_groups} does not divide num_heads * head_dim = "
                           f"{self.num_heads * self.head_dim}", ("o_groups",))
        if self.moe.experts_per_token > self.moe.experts:
            raise _problem(f"{self.moe.experts_per_token} is more than moe.experts = {self.moe.experts}",
                           ("moe", "experts_per_token"))
        if self.moe.hash_layers > self.num_layers:
            raise _problem(f"{self.moe.hash_layers} is more than num_layers = {self.num_layers}",
                           ("moe", "hash_layers"))
        expected = self.num_layers + self.draft.stages
        if len(self.compress_ratios) != expected:
            raise _problem(f"has {len(self.compress_ratios)} entries; expected num_layers + draft.stages"
                           f" = {expected}", ("compress_ratios",))
        allowed = (0, self.csa_ratio, self.hca_ratio)
        for i, ratio in enumerate(self.compress_ratios):
            if i >= self.num_layers and ratio != 0:
                raise _problem(f"MTP stage entry is {ratio}; MTP stages use the window only, so it must be 0",
                               ("compress_ratios", i))
            if ratio not in allowed:
                raise _problem(f"{ratio} is not 0, csa_ratio {self.csa_ratio} or hca_ratio {self.hca_ratio}",
                               ("compress_ratios", i))
        for ratio in (self.csa_ratio, self.hca_ratio):
            if self.max_seq_len % ratio:
                raise _problem(f"{self.max_seq_len} is not a multiple of compress ratio {ratio}", ("max_seq_len",))
        return self


class StagingSpec(_Spec):
    layout: Literal["NHD", "HND"]
    page_size: Annotated[PosInt, _check(lambda v: v & (v - 1) == 0, "a power of two")]


class CacheSpec(_Spec):
    history: PosInt
    window_format: Literal["mxfp8", "bf16", "fp32"]
    compressed_format: Literal["nvfp4", "mxfp8", "bf16", "fp32"]
    state_format: Literal["fp32"]
    index_format: Literal["mxfp8", "bf16", "fp32"] = "fp32"  # CSA index keys (deepseek_v4)
    staging: StagingSpec


class PrefillPass(_Spec):
    chunk: PosInt
    rows_buckets: Buckets


class WidthPass(_Spec):
    """verify or draft: ``width`` tokens per row, captured once per rows bucket."""

    width: PosInt
    rows_buckets: Buckets


class CommitPass(_Spec):
    rows_buckets: Buckets


class Passes(_Spec):
    prefill: PrefillPass
    verify: WidthPass
    draft: WidthPass
    commit: CommitPass

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
        raise _problem(f"missing {', '.join(missing)}; expected exactly the keys {', '.join(PASS_NAMES)}")
    return counts


class RewriteSpec(_Spec):
    name: Annotated[str, Strict(), AfterValidator(_known_rewrite)]
    # How often the rewrite is expected to match in each pass graph.
    expect_matches: Annotated[dict[PassName, NonNegInt], AfterValidator(_all_passes)]


class Recipe(_Spec):
    recipe_version: Annotated[Literal[1], BeforeValidator(_no_bool)]
    name: Annotated[str, Strict(), Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")]
    model: Annotated[ModelSpec | V4ModelSpec, Field(discriminator="family")]
    cache: CacheSpec
    passes: Passes
    rewrites: tuple[RewriteSpec, ...] = ()

    @property
    def pass_names(self) -> tuple[str, ...]:
        return PASS_NAMES

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
        for i, rewrite in enumerate(self.rewrites):
            if any(r.name == rewrite.name for r in self.rewrites[:i]):
                raise _problem(f"rewrite {rewrite.name!r} is listed twice", ("rewrites", i, "name"))
            if rewrite.name == "fuse_window_snapshot":
                self._check_window_fusion(i, rewrite)
        return self

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
        sites = {"prefill": 0, "verify": self.model.num_layers, "draft": draft_sites, "commit": 0}
        for pass_name, expected in rewrite.expect_matches.items():
            if expected > sites[pass_name]:
                raise _problem(f"{expected} matches are impossible: the {pass_name} graph has {sites[pass_name]} "
                               f"window snapshot sites", ("rewrites", index, "expect_matches", pass_name))

    def normalized(self) -> dict[str, Any]:
        """All fields, defaults filled, as plain JSON data with keys sorted recursively."""
        return _sort_keys(self.model_dump(mode="json"))

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
    return sorted(p.name[: -len(".yaml")] for p in files("b12x.recipes").iterdir() if p.name.endswith(".yaml"))


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
    return parse_recipe((files("b12x.recipes") / label).read_bytes(), label)


def _read_file(path: Path, label: str) -> bytes:
    try:
        if not path.is_file():
            reason = "is not a regular file" if path.exists() else "does not exist"
            raise RecipeError(label, None, "", f"recipe file {label} {reason}")
        # Check the size before reading so a huge file is never loaded into memory.
        size = path.stat().st_size
        if size > MAX_DOCUMENT_BYTES:
            raise RecipeError(label, None, "", f"document is {size} bytes; the limit is"
                              f" {MAX_DOCUMENT_BYTES} bytes (1 MiB)")
        return path.read_bytes()
    except OSError as exc:
        raise RecipeError(label, None, "", f"cannot read recipe file {label}: {exc.strerror or exc}") from None
