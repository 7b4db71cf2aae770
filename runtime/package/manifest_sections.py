"""The manifest's sections besides the passes and buffers: the model's facts, the rewrites'
results, where the weights come from and the tokenizer a package may carry, each with its
`to_json` and strict `from_json` (manifest.py composes them). Every refusal names the field
and what was expected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from b12x_toolchain.runtime.errors import PackageError
from b12x_toolchain.runtime.formats.weight_formats import WeightFormat

WHERE = "manifest.json"
MODEL_FIELDS = ("family", "vocab_size", "max_seq_len", "noise_token_id", "confidence_threshold")
REWRITE_FIELDS = ("matches", "nodes_before", "nodes_after")
ACTIVATION_RULES = ("none", "deepseek")
TOKENIZER_FIELDS = ("file", "eos_token_id", "pad_token_id", "chat_template")


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_str_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def expect(ok: bool, field: str, value, expected: str) -> None:
    if not ok:
        raise PackageError(f"{WHERE}: {field}: {value!r:.200} is not {expected}")


def expect_keys(data: dict, field: str, required, optional=()) -> None:
    missing = sorted(set(required) - set(data))
    unknown = sorted(set(data) - set(required) - set(optional))
    if missing or unknown:
        problems = ([f"fields missing {missing}"] if missing else []) + ([f"unknown fields {unknown}"] if unknown else [])
        raise PackageError(f"{WHERE}: {field}: {'; '.join(problems)}")


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
        expect(isinstance(data, dict), "model", data, "an object")
        expect_keys(data, "model", MODEL_FIELDS, ("capabilities",))
        expect(isinstance(data["family"], str), "model.family", data["family"], "a string")
        for field in ("vocab_size", "max_seq_len"):
            expect(is_count(data[field]) and data[field] > 0, f"model.{field}", data[field], "a positive integer")
        expect(is_count(data["noise_token_id"]) and 0 <= data["noise_token_id"] < data["vocab_size"],
                "model.noise_token_id", data["noise_token_id"], "a token id below vocab_size")
        threshold = data["confidence_threshold"]
        expect(isinstance(threshold, (int, float)) and not isinstance(threshold, bool),
                "model.confidence_threshold", threshold, "a number")
        caps = data.get("capabilities")
        expect(caps is None or (isinstance(caps, dict) and all(isinstance(v, bool) for v in caps.values())),
                "model.capabilities", caps, "an object of flags")
        return cls(data["family"], data["vocab_size"], data["max_seq_len"], data["noise_token_id"], threshold,
                   None if caps is None else dict(caps))


@dataclass(frozen=True)
class TokenizerFacts:
    """The tokenizer a package carries (runtime/serving/text.py reads it): its Hugging Face
    files, the eos and pad ids their config names (None: it names none), and whether the
    config holds a chat template. Files are listed, hashed and checked like every other."""

    file: str  # tokenizer.json
    config: str | None  # tokenizer_config.json, when the checkpoint had one
    eos_token_id: int | None
    pad_token_id: int | None
    chat_template: bool

    def to_json(self) -> dict:
        out = {f: getattr(self, f) for f in TOKENIZER_FIELDS}
        if self.config is not None:
            out["config"] = self.config
        return out

    @classmethod
    def from_json(cls, data, files: dict, vocab_size: int) -> "TokenizerFacts":
        expect(isinstance(data, dict), "tokenizer", data, "an object")
        expect_keys(data, "tokenizer", TOKENIZER_FIELDS, ("config",))
        config = data.get("config")
        for field, name in (("file", data["file"]), ("config", config)):
            if name is not None:
                expect(isinstance(name, str) and name in files, f"tokenizer.{field}", name, "a file the package lists")
        for field in ("eos_token_id", "pad_token_id"):
            value = data[field]
            expect(value is None or (is_count(value) and 0 <= value < vocab_size), f"tokenizer.{field}", value,
                   f"null or a token id below model.vocab_size ({vocab_size})")
        expect(isinstance(data["chat_template"], bool) and (config is not None or not data["chat_template"]),
               "tokenizer.chat_template", data["chat_template"], "a boolean, true only with a config file")
        return cls(data["file"], config, data["eos_token_id"], data["pad_token_id"], data["chat_template"])


@dataclass(frozen=True)
class RewriteResult:
    """What one rewrite did to one pass's graph, as the manifest records it (the rewrite kit's
    RewriteResult, less its name and changed flag)."""

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
        expect(isinstance(data, dict), "rewrites", data, "an object")
        expect_keys(data, "rewrites", ("pipeline", "results"))
        pipeline, results = data["pipeline"], data["results"]
        expect(isinstance(pipeline, list) and all(isinstance(n, str) for n in pipeline), "rewrites.pipeline",
                pipeline, "a list of rewrite names")
        expect(isinstance(results, dict) and all(isinstance(v, dict) for v in results.values()),
                "rewrites.results", results, "an object of pass -> rewrite -> result")
        typed = {}
        for pass_name, by_rewrite in results.items():
            typed[pass_name] = {}
            for rewrite, result in by_rewrite.items():
                field = f"rewrites.results.{pass_name}.{rewrite}"
                expect(isinstance(result, dict), field, result, "an object")
                expect_keys(result, field, REWRITE_FIELDS)
                for name in REWRITE_FIELDS:
                    expect(is_count(result[name]) and result[name] >= 0, f"{field}.{name}", result[name],
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
    whose ranks name theirs) or, `external`, a checkpoint holding `tensors`.

    `formats`: the storage format (runtime/formats/weight_formats.py) of every weight not in
    fp32, by the weight's name; its scale tensor is the name plus `_scale`. `activation`: how
    the quantized linears treat their inputs, `none` or `deepseek` (E4M3 per token per 128
    channels first). Both are written only when some weight is not fp32, so an all-fp32
    package reads and hashes as before they existed. `engram_tables`: the weights that are Engram tables (data
    and scales), which a session may keep in host memory (`engram_tables="host"`); written
    only when the model has Engram."""

    source: str
    file: str | None = None
    external: bool = False
    tensors: dict[str, WeightTensor] | None = None
    formats: dict[str, WeightFormat] = dataclasses.field(default_factory=dict)
    activation: str = "none"
    engram_tables: tuple[str, ...] = ()

    def to_json(self) -> dict:
        if self.external:
            out = {"external": True, "source": self.source,
                   "tensors": {n: t.to_json() for n, t in self.tensors.items()}}
        else:
            out = {"file": self.file, "source": self.source}
        if self.formats:
            out.update(formats={n: f.to_json() for n, f in sorted(self.formats.items())}, activation=self.activation)
        if self.engram_tables:
            out["engram_tables"] = list(self.engram_tables)
        return out

    @classmethod
    def from_json(cls, data) -> "Weights":
        if not isinstance(data, dict):
            raise PackageError(f"{WHERE}: 'weights' is missing or not an object")
        external = data.get("external", False)
        expect(isinstance(external, bool), "weights.external", external, "a boolean")
        expect(isinstance(data.get("source"), str), "weights.source", data.get("source"), "a string")
        formats, activation = _formats(data)
        tables = data.get("engram_tables", [])
        expect(isinstance(tables, list) and all(isinstance(n, str) and n for n in tables)
               and len(set(tables)) == len(tables) and ("engram_tables" not in data or tables),
               "weights.engram_tables", tables, "a non-empty list of distinct weight names")
        if not external:
            expect_keys(data, "weights", ("file", "source"), ("external", "formats", "activation", "engram_tables"))
            expect(data["file"] is None or isinstance(data["file"], str), "weights.file", data["file"],
                    "a file name or null")
            return cls(data["source"], data["file"], formats=formats, activation=activation,
                       engram_tables=tuple(tables))
        expect_keys(data, "weights", ("external", "source"), ("tensors", "formats", "activation", "engram_tables"))
        tensors = data.get("tensors")
        if not isinstance(tensors, dict):
            raise PackageError(f"{WHERE}: weights are external but 'weights.tensors' is missing")
        return cls(data["source"], None, True, {n: _weight_tensor(n, t) for n, t in tensors.items()}, formats,
                   activation, tuple(tables))


def check_engram_tables(tables, weight_dtypes: dict[str, str]) -> None:
    """Each listed Engram table is a weight input."""
    for name in tables:
        if name not in weight_dtypes:
            raise PackageError(f"{WHERE}: weights.engram_tables lists {name}, which is no weight input of the passes")


def check_weight_formats(formats: dict[str, WeightFormat], weight_dtypes: dict[str, str]) -> None:
    """Each listed weight is a weight input in its format's dtype, a block-scaled one with its scale."""
    for name, fmt in sorted(formats.items()):
        stored = {name: fmt.data_dtype, **({name + "_scale": fmt.scale_dtype} if fmt.quantized else {})}
        for tensor, dtype in stored.items():
            if weight_dtypes.get(tensor) != dtype:
                found = "no weight input" if tensor not in weight_dtypes else f"a {weight_dtypes[tensor]} input"
                raise PackageError(f"{WHERE}: weights.formats.{name} is {fmt.describe()}, stored as {dtype} {tensor}; "
                                   f"the passes have {found}")


def _formats(data: dict) -> tuple[dict[str, WeightFormat], str]:
    """weights.formats and weights.activation: both or neither, fp32 never listed (the default)."""
    if "formats" not in data and "activation" not in data:
        return {}, "none"
    if ("formats" in data) != ("activation" in data):
        raise PackageError(f"{WHERE}: weights: 'formats' and 'activation' are written together; one is missing")
    formats, activation = data["formats"], data["activation"]
    expect(isinstance(formats, dict) and formats, "weights.formats", formats, "an object of weight -> format")
    expect(activation in ACTIVATION_RULES, "weights.activation", activation, f"one of {', '.join(ACTIVATION_RULES)}")
    typed = {}
    for name, entry in formats.items():
        try:
            typed[name] = WeightFormat.from_json(entry, f"weights.formats.{name}")
        except ValueError as exc:
            raise PackageError(f"{WHERE}: {exc}") from None
        expect(typed[name].kind != "fp32", f"weights.formats.{name}", entry, "another format than fp32 (the default, "
               "never listed)")
    return typed, activation


def _weight_tensor(name: str, data) -> WeightTensor:
    field = f"weights.tensors.{name}"
    expect(isinstance(data, dict), field, data, "an object")
    expect_keys(data, field, ("dtype", "shape"), ("sha256",))
    shape, checksum = data["shape"], data.get("sha256")
    expect(isinstance(data["dtype"], str), f"{field}.dtype", data["dtype"], "a dtype name")
    expect(isinstance(shape, list) and all(is_count(s) and s >= 0 for s in shape), f"{field}.shape", shape,
            "a list of sizes")
    expect(checksum is None or isinstance(checksum, str), f"{field}.sha256", checksum, "a hex digest")
    return WeightTensor(data["dtype"], tuple(shape), checksum)
