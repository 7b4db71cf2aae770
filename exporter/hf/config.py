"""A Hugging Face DeepSeek V4 or V4.1 `config.json`, read as the model section of a recipe.

`model_fields` maps the config's keys onto the `deepseek_v4` or `deepseek_v41` model fields
and remembers which key each field came from, so both `b12x recipe from-hf` and the
checkpoint import (which checks config.json against a recipe) can name the key at fault.
The config is read as plain JSON: `transformers` is not needed, and nothing in it is executed.

Keys are read as `transformers.DeepseekV4Config` reads them, including its legacy
spellings (`compress_ratios`, `compress_rate_csa`, `num_hash_layers`, `qk_rope_head_dim`,
`rope_scaling`). A value b12x's model cannot reproduce is refused, naming the key;
nothing is silently defaulted that would change the model.

A config is DeepSeek V4.1's when its model_type is `deepseek_v41` or it has any of V4.1's
CSA2 or DSpark keys (`V41_KEYS`: kv_source_layer_ids, ..., dspark_*); a V4.1 config must
then have all of the required ones. Engram keys alone do not make a config V4.1's (the
rest of its model would still be read as V4's), so a V4 config with them is refused.
V4.1 differs from V4 where b12x's `deepseek_v41` family does, and no key selects it: its
blocks have no per-head q RMSNorm, and its compressors are CSA2's. Its per-layer
`compress_ratios` are the ratios themselves (0, 1 or 2, not V4's 0 / 4 / 128 kinds);
`layer_types` with `compress_rates` may say the same if each rate is 1 or 2. Its
`num_nextn_predict_layers` counts the DSpark stages (`mtp.0` ...), whose routed experts
are `dspark_n_routed_experts` / `dspark_num_experts_per_tok`; their other MoE widths and
rules are the target's keys. `dspark_block_size`, the drafted block (anchor + noise
tokens), is not a model field: `recipe_from_hf_config` makes it the draft pass's width.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

from b12x_toolchain.exporter.errors import HfConfigError  # noqa: F401  (re-exported)

__all__ = ["HfConfigError", "V41_KEYS", "dspark_block_size", "engram_section", "is_v41", "model_fields", "read_config",
           "recipe_from_hf_config", "recipe_name", "tied_embeddings"]

CONFIG = "config.json"
CONFIG_LIMIT = 4 << 20  # a real V4 config is a few KB; the cap keeps a wrong file from being parsed
CSA, HCA, WINDOW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
# transformers' own table for the legacy per-layer `compress_ratios`: the number picks the
# layer kind, and the kind's rate then comes from `compress_rates`.
LEGACY_RATIO_KINDS = {0: WINDOW, 4: CSA, 128: HCA}
SCORING = ("sqrtsoftplus", "sigmoid", "softmax")
YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
# Accepted and ignored, as transformers' V4 ignores them: it fixes attention_factor at 1.0
# (so mscale cannot matter) and reads `truncate` from a level V4 never writes it to.
YARN_IGNORED = {"mscale", "mscale_all_dim", "truncate"}
# DeepSeek V4.1's Engram keys -> the recipe's model.engram fields, with each value's minimum.
# engram_vocab_size is where the prime search starts, not a row count.
ENGRAM_KEYS = (
    ("max_ngram", "engram_max_ngram_size", 2), ("heads_per_order", "engram_n_heads", 1),
    ("head_dim", "engram_head_dim", 32), ("prime_search_start", "engram_vocab_size", 2),
    ("compressed_vocab_size", "engram_compressed_vocab_size", 1), ("pad_id", "engram_pad_token_id", 0),
)
ENGRAM_IDS, ENGRAM_ROWS = "engram_layer_ids", "engram_num_embeddings"
# DeepSeek V4.1's CSA2 and DSpark keys; any of them makes a config V4.1's. The candidate
# keys may be absent (no hierarchical candidates); the others are required.
V41_KEYS = ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks",
            "candidate_block_size", "dspark_block_size", "dspark_target_layer_ids", "dspark_noise_token_id",
            "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok")
V41_TYPE = "deepseek_v41"
V41_RATIOS = (0, 1, 2)


def read_config(path) -> dict[str, Any]:
    """Parse a config.json (or the one in a checkpoint directory) as a JSON object."""
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG
    if not path.is_file():
        raise HfConfigError(f"{path}: " + ("not a regular file" if path.exists() else "does not exist"))
    if path.stat().st_size > CONFIG_LIMIT:
        raise HfConfigError(f"{path}: larger than {CONFIG_LIMIT} bytes; not a model config")
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bad UTF-8
        raise HfConfigError(f"{path}: not readable as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise HfConfigError(f"{path}: top level is a {type(data).__name__}; expected a JSON object")
    return data


# --- typed reads, each naming its key -----------------------------------------------

def _given(config: dict, key: str) -> bool:
    return config.get(key) is not None


def _required(config: dict, key: str, why: str = "") -> Any:
    if not _given(config, key):
        raise HfConfigError(f"{key}: missing from config.json{why}")
    return config[key]


def _int(value: Any, key: str, minimum: int = 1) -> int:
    # bool is an int in Python; `true` is never a size.
    if isinstance(value, bool) or not isinstance(value, int):
        raise HfConfigError(f"{key}: {value!r} is not an integer")
    if value < minimum:
        raise HfConfigError(f"{key}: {value} is less than {minimum}")
    return value


def _float(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise HfConfigError(f"{key}: {value!r} is not a positive number")
    return float(value)


def _choice(value: Any, key: str, allowed: tuple) -> Any:
    if value not in allowed:
        raise HfConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, allowed))}")
    return value


def _list(value: Any, key: str) -> list:
    if not isinstance(value, list):
        raise HfConfigError(f"{key}: {value!r} is not a list")
    return value


class _Fields:
    """The model fields being built, each with the config key it was read from."""

    def __init__(self, config: dict):
        self.config, self.values, self.sources = config, {}, {}

    def set(self, path: str, value: Any, source: str) -> Any:
        self.values[path], self.sources[path] = value, source
        return value

    def read_int(self, path: str, key: str, minimum: int = 1) -> int:
        return self.set(path, _int(_required(self.config, key), key, minimum), key)

    def read_float(self, path: str, key: str) -> float:
        return self.set(path, _float(_required(self.config, key), key), key)


# --- the mapping --------------------------------------------------------------------

def is_v41(config: dict) -> bool:
    """Whether config.json is DeepSeek V4.1's: model_type `deepseek_v41`, or any CSA2 / DSpark key."""
    return config.get("model_type") == V41_TYPE or any(_given(config, key) for key in V41_KEYS)


def _family_source(config: dict) -> str:
    """The key that makes the config V4.1's (model_type, else its first V4.1 key), or V4's model_type."""
    if config.get("model_type") == V41_TYPE:
        return "model_type"
    return next((key for key in V41_KEYS if _given(config, key)), "model_type")


def _unsupported(config: dict) -> None:
    """Keys whose only value b12x's V4 model implements; absent means transformers' default, which is it."""
    if _required(config, "model_type") not in ("deepseek_v4", V41_TYPE):
        raise HfConfigError(f"model_type: {config['model_type']!r} is not 'deepseek_v4' or '{V41_TYPE}'")
    for key, supported, why in (
        ("num_key_value_heads", 1, "DeepSeek V4 attention shares one KV head"),
        ("hidden_act", "silu", "the experts are SwiGLU"),
        ("mlp_bias", False, "the shared expert has no biases"),
    ):
        value = config.get(key)
        if value is not None and (value != supported or type(value) is not type(supported)):
            raise HfConfigError(f"{key}: {config[key]!r} is not supported; b12x implements {supported!r} ({why})")


def _rope_head_dim(f: _Fields, head_dim: int) -> int:
    config = f.config
    rope_dim = source = None
    if _given(config, "partial_rotary_factor"):
        factor = _float(config["partial_rotary_factor"], "partial_rotary_factor")
        exact = head_dim * factor
        if abs(exact - round(exact)) > 1e-6:
            raise HfConfigError(f"partial_rotary_factor: {factor} * head_dim {head_dim} = {exact} is not a whole "
                                "number of dimensions")
        rope_dim, source = round(exact), "partial_rotary_factor"
    if _given(config, "qk_rope_head_dim"):
        legacy = _int(config["qk_rope_head_dim"], "qk_rope_head_dim")
        if rope_dim is not None and legacy != rope_dim:
            raise HfConfigError(f"qk_rope_head_dim: {legacy} disagrees with partial_rotary_factor * head_dim"
                                f" = {rope_dim}")
        rope_dim, source = legacy, source or "qk_rope_head_dim"
    if rope_dim is None:
        raise HfConfigError("partial_rotary_factor: missing from config.json (and no qk_rope_head_dim)")
    return f.set("rope_head_dim", rope_dim, source)


def _kind_rates(config: dict) -> dict[str, tuple[int, str]]:
    """compress_rates (and its legacy scalars) as {layer kind: (rate, key)}."""
    rates = {}
    if _given(config, "compress_rates"):
        given = config["compress_rates"]
        if not isinstance(given, dict):
            raise HfConfigError(f"compress_rates: {given!r} is not an object")
        for kind, rate in given.items():
            _choice(kind, "compress_rates", (CSA, HCA))
            rates[kind] = (_int(rate, f"compress_rates.{kind}"), f"compress_rates.{kind}")
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if _given(config, legacy):  # transformers lets the legacy scalars override the dict
            rates[kind] = (_int(config[legacy], legacy), legacy)
    return rates


def _rates(f: _Fields) -> dict[str, int]:
    rates = _kind_rates(f.config)
    for kind, path in ((CSA, "csa_ratio"), (HCA, "hca_ratio")):
        if kind not in rates:
            raise HfConfigError(f"compress_rates.{kind}: missing from config.json")
        f.set(path, *rates[kind])
    return {WINDOW: 0, CSA: rates[CSA][0], HCA: rates[HCA][0]}


def _layer_types(config: dict, layers: int) -> list[str]:
    kinds = _list(config["layer_types"], "layer_types")
    if len(kinds) != layers:
        raise HfConfigError(f"layer_types: has {len(kinds)} entries; num_hidden_layers is {layers}")
    for i, kind in enumerate(kinds):
        _choice(kind, f"layer_types[{i}]", (WINDOW, CSA, HCA))
    return kinds


def _compress_ratios(f: _Fields, layers: int, stages: int) -> list[int]:
    config, rates = f.config, _rates(f)
    if _given(config, "layer_types"):
        kinds, source = _layer_types(config, layers), "layer_types"
    elif _given(config, "compress_ratios"):
        legacy = _list(config["compress_ratios"], "compress_ratios")
        if len(legacy) not in (layers, layers + stages):
            raise HfConfigError(f"compress_ratios: has {len(legacy)} entries; expected num_hidden_layers = {layers}"
                                f" (or {layers + stages} with the MTP stage)")
        kinds = []
        for i, ratio in enumerate(legacy):
            key = f"compress_ratios[{i}]"
            if i >= layers:  # the MTP stage's own entry: b12x's MTP stage attends its window only
                if ratio != 0:
                    raise HfConfigError(f"{key}: the MTP stage's entry is {ratio!r}; b12x's MTP stage is "
                                        "window-only (0)")
                continue
            kinds.append(LEGACY_RATIO_KINDS[_choice(_int(ratio, key, 0), key, tuple(LEGACY_RATIO_KINDS))])
        source = "compress_ratios"
    else:
        raise HfConfigError("layer_types: missing from config.json (and no legacy compress_ratios)")
    return f.set("compress_ratios", [rates[kind] for kind in kinds] + [0] * stages, source)


def _v41_ratios(f: _Fields, layers: int, stages: int) -> list[int]:
    """V4.1's per-layer ratios from `compress_ratios` (the ratios themselves) or `layer_types`
    with `compress_rates`; where both are given they must agree."""
    config = f.config
    ratios = source = None
    if _given(config, "layer_types"):
        kinds, rates = _layer_types(config, layers), _kind_rates(config)
        for kind in (CSA, HCA):
            if kind in kinds and kind not in rates:
                raise HfConfigError(f"compress_rates.{kind}: missing from config.json (layer_types has {kind})")
            if kind in rates:
                _choice(rates[kind][0], rates[kind][1], V41_RATIOS[1:])
        ratios, source = [0 if kind == WINDOW else rates[kind][0] for kind in kinds], "layer_types"
    if _given(config, "compress_ratios"):
        given = _list(config["compress_ratios"], "compress_ratios")
        if len(given) not in (layers, layers + stages):
            raise HfConfigError(f"compress_ratios: has {len(given)} entries; expected num_hidden_layers = {layers}"
                                f" (or {layers + stages} with the {stages} DSpark stages)")
        for i, ratio in enumerate(given):
            key = f"compress_ratios[{i}]"
            if i >= layers:  # a DSpark stage's entry: the stages attend their window only
                if ratio != 0 or isinstance(ratio, bool):
                    raise HfConfigError(f"{key}: DSpark stage {i - layers}'s entry is {ratio!r}; draft stages are "
                                        "window-only (0)")
                continue
            _choice(_int(ratio, key, 0), key, V41_RATIOS)
        if ratios is not None and given[:layers] != ratios:
            raise HfConfigError(f"compress_ratios: {given[:layers]} disagrees with layer_types and compress_rates,"
                                f" which give {ratios}")
        ratios, source = given[:layers], source or "compress_ratios"
    if ratios is None:
        raise HfConfigError("compress_ratios: missing from config.json (and no layer_types)")
    return f.set("compress_ratios", [*ratios, *[0] * stages], source)


def _layer_ids(f: _Fields, path: str, key: str, layers: int) -> list[int]:
    """A list of distinct target layer ids in increasing order, each below num_hidden_layers."""
    ids = _list(_required(f.config, key, " (a DeepSeek V4.1 config)"), key)
    values = [_int(v, f"{key}[{i}]", 0) for i, v in enumerate(ids)]
    if not values or values != sorted(set(values)):
        raise HfConfigError(f"{key}: {ids!r}; expected distinct layer ids in increasing order")
    for i, layer in enumerate(values):
        if layer >= layers:
            raise HfConfigError(f"{key}[{i}]: layer {layer} is out of range; num_hidden_layers is {layers}")
    return f.set(path, values, key)


def _csa2(f: _Fields, layers: int) -> None:
    config = f.config
    _layer_ids(f, "csa2.kv_source_layer_ids", "kv_source_layer_ids", layers)
    _layer_ids(f, "csa2.index_source_layer_ids", "index_source_layer_ids", layers)
    candidate = "candidate_source_layer_id"
    if _given(config, candidate):
        layer = f.set(f"csa2.{candidate}", _int(config[candidate], candidate, 0), candidate)
        if layer >= layers:
            raise HfConfigError(f"{candidate}: layer {layer} is out of range; num_hidden_layers is {layers}")
    why = f" ({candidate} is given)" if _given(config, candidate) else ""
    for key in ("candidate_topk_blocks", "candidate_block_size"):
        if why or _given(config, key):  # without a candidate source they keep no candidates, but are kept as given
            f.set(f"csa2.{key}", _int(_required(config, key, why), key), key)


def _dspark(f: _Fields, layers: int, stages: int) -> None:
    """The DSpark drafter: its own keys, and the target's for the MoE fields it has no key of."""
    f.set("draft.stages", stages, "num_nextn_predict_layers")
    _layer_ids(f, "draft.target_layer_ids", "dspark_target_layer_ids", layers)
    f.set("draft.noise_token_id", _int(_required(f.config, "dspark_noise_token_id"), "dspark_noise_token_id", 0),
          "dspark_noise_token_id")
    f.read_int("draft.markov_rank", "dspark_markov_rank")
    f.read_int("draft.moe.experts", "dspark_n_routed_experts")
    f.read_int("draft.moe.experts_per_token", "dspark_num_experts_per_tok")
    for field in ("shared_experts", "intermediate_size", "scoring", "routed_scaling_factor", "swiglu_limit"):
        f.set(f"draft.moe.{field}", f.values[f"moe.{field}"], f.sources[f"moe.{field}"])


def dspark_block_size(config: dict) -> int:
    """DSpark's trained block, anchor and noise tokens together: the draft pass's width."""
    return _int(_required(config, "dspark_block_size", " (a DeepSeek V4.1 config)"), "dspark_block_size")


def _hash_layers(f: _Fields, layers: int) -> int:
    config = f.config
    if _given(config, "mlp_layer_types"):
        kinds = _list(config["mlp_layer_types"], "mlp_layer_types")
        if len(kinds) != layers:
            raise HfConfigError(f"mlp_layer_types: has {len(kinds)} entries; num_hidden_layers is {layers}")
        hashed = 0
        for i, kind in enumerate(kinds):
            _choice(kind, f"mlp_layer_types[{i}]", ("hash_moe", "moe"))
            if kind == "hash_moe":
                if hashed != i:  # the recipe has one count: hash routing in the leading layers only
                    raise HfConfigError(f"mlp_layer_types[{i}]: hash_moe follows a moe layer; b12x supports "
                                        "hash-routed layers only before all routed ones")
                hashed += 1
        return f.set("moe.hash_layers", hashed, "mlp_layer_types")
    if _given(config, "num_hash_layers"):
        return f.set("moe.hash_layers", min(layers, _int(config["num_hash_layers"], "num_hash_layers", 0)),
                     "num_hash_layers")
    raise HfConfigError("mlp_layer_types: missing from config.json (and no legacy num_hash_layers)")


def _rope_sections(config: dict) -> tuple[dict, dict, str, str, bool]:
    """(main, compress, main key, compress key, nested): the two RoPE parameter sets as written."""
    for key in ("rope_parameters", "rope_scaling"):  # rope_scaling: the older name of the same flat dict
        given = config.get(key)
        if given is None:
            continue
        if not isinstance(given, dict):
            raise HfConfigError(f"{key}: {given!r} is not an object")
        if isinstance(given.get("main"), dict) and isinstance(given.get("compress"), dict):
            return given["main"], given["compress"], f"{key}.main", f"{key}.compress", True
        # Flat: transformers applies it to the compressed layers (the main RoPE is plain) and
        # overwrites its rope_theta and partial_rotary_factor from the top-level keys.
        flat = {k: v for k, v in given.items() if k not in ("main", "compress", "rope_theta", "partial_rotary_factor")}
        return {}, flat, f"{key}.main", key, False
    return {}, {}, "rope_parameters.main", "rope_parameters", False


def _theta(f: _Fields, path: str, top: str, section: dict, where: str, nested: bool) -> None:
    """A RoPE base: nested sections win in transformers, the top-level key otherwise; both must agree."""
    config = f.config
    if nested and "rope_theta" in section:
        value = f.set(path, _float(section["rope_theta"], f"{where}.rope_theta"), f"{where}.rope_theta")
        if _given(config, top) and _float(config[top], top) != value:
            raise HfConfigError(f"{top}: {config[top]} disagrees with {where}.rope_theta = {section['rope_theta']}")
        return
    value = f.read_float(path, top)
    if "rope_theta" in section and _float(section["rope_theta"], f"{where}.rope_theta") != value:
        raise HfConfigError(f"{where}.rope_theta: {section['rope_theta']} disagrees with {top} = {config[top]}")


def _rope(f: _Fields, head_dim: int, rope_dim: int) -> None:
    main, compress, main_key, compress_key, nested = _rope_sections(f.config)
    for section, where in ((main, main_key), (compress, compress_key)):
        if section.get("partial_rotary_factor") is not None:
            factor = _float(section["partial_rotary_factor"], f"{where}.partial_rotary_factor")
            if abs(head_dim * factor - rope_dim) > 1e-6:
                raise HfConfigError(f"{where}.partial_rotary_factor: {factor} * head_dim {head_dim} disagrees with "
                                    f"rope_head_dim {rope_dim}")
    _theta(f, "rope_theta", "rope_theta", main, main_key, nested)
    _theta(f, "compress_rope_theta", "compress_rope_theta", compress, compress_key, nested)
    if main.get("rope_type", main.get("type", "default")) != "default":
        raise HfConfigError(f"{main_key}.rope_type: {main.get('rope_type', main.get('type'))!r} is not supported; "
                            "b12x's window-only RoPE is plain ('default')")
    _unknown(main, main_key, ROPE_KEYS)
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind == "default":
        _unknown(compress, compress_key, ROPE_KEYS)
        f.set("yarn", None, compress_key)
        return
    _choice(kind, f"{compress_key}.rope_type", ("default", "yarn"))
    _unknown(compress, compress_key, ROPE_KEYS | set(YARN_KEYS) | {"attention_factor"} | YARN_IGNORED)
    # The V4 reference never rescales cos/sin. transformers fills in attention_factor 1.0 for
    # a flat rope_parameters only; a nested one without it gets YaRN's mscale (about 1.28).
    factor = compress.get("attention_factor", None if nested else 1.0)
    if factor is None or isinstance(factor, bool) or factor != 1:
        raise HfConfigError(f"{compress_key}.attention_factor: {'missing' if factor is None else repr(factor)}; "
                            "b12x implements DeepSeek V4's YaRN, which does not rescale cos/sin (1.0)")
    yarn = {
        "factor": _float(_required_in(compress, "factor", compress_key), f"{compress_key}.factor"),
        "original_max_position_embeddings": _int(
            _required_in(compress, "original_max_position_embeddings", compress_key),
            f"{compress_key}.original_max_position_embeddings"),
        # transformers reads a missing (or zero) beta as the YaRN paper's 32 and 1
        "beta_fast": _float(compress.get("beta_fast") or 32.0, f"{compress_key}.beta_fast"),
        "beta_slow": _float(compress.get("beta_slow") or 1.0, f"{compress_key}.beta_slow"),
    }
    f.set("yarn", yarn, compress_key)


def _unknown(section: dict, where: str, allowed: set) -> None:
    for key in section:
        if key not in allowed:
            raise HfConfigError(f"{where}.{key}: not a RoPE parameter b12x implements")


def _required_in(section: dict, key: str, where: str) -> Any:
    if section.get(key) is None:
        raise HfConfigError(f"{where}.{key}: missing from config.json")
    return section[key]


def model_fields(config: dict) -> tuple[dict[str, Any], dict[str, str]]:
    """The recipe's `deepseek_v4` or `deepseek_v41` model fields that config.json fixes, as
    dotted paths (`moe.experts`), and for each path the config key it came from.

    max_seq_len and init_seed are not the checkpoint's to say: they come from elsewhere, and
    neither are the weights' formats (`quantization_config`: quantization.py gives the
    recipe's `weights` section from it, and the checkpoint import checks it against that).
    A V4.1 config's Engram keys are `engram_section`'s; its DSpark confidence threshold is
    a sampling choice, not the checkpoint's.
    """
    _unsupported(config)
    v41 = is_v41(config)
    f = _Fields(config)
    f.set("family", V41_TYPE if v41 else "deepseek_v4", _family_source(config))
    for path, key in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                      ("num_layers", "num_hidden_layers"), ("num_heads", "num_attention_heads"),
                      ("head_dim", "head_dim")):
        f.read_int(path, key)
    rope_dim = _rope_head_dim(f, f.values["head_dim"])
    for key in ("q_lora_rank", "o_groups", "o_lora_rank"):
        f.read_int(key, key)
    stages = _int(_required(config, "num_nextn_predict_layers"), "num_nextn_predict_layers", 0)
    if v41 and stages == 0:
        raise HfConfigError("num_nextn_predict_layers: 0; the recipe needs DSpark draft stages (mtp.0 ...), and a "
                            "checkpoint without them has none to export")
    if not v41 and stages != 1:
        need = ("the recipe needs one MTP draft stage, and a checkpoint without MTP weights has none to export"
                if stages == 0 else "b12x supports exactly one MTP draft stage")
        raise HfConfigError(f"num_nextn_predict_layers: {stages}; {need}")
    layers = f.values["num_layers"]
    (_v41_ratios if v41 else _compress_ratios)(f, layers, stages)
    f.read_int("window", "sliding_window")
    f.read_float("rms_norm_eps", "rms_norm_eps")
    _rope(f, f.values["head_dim"], rope_dim)
    f.read_int("indexer.heads", "index_n_heads")
    f.read_int("indexer.head_dim", "index_head_dim")
    f.read_int("indexer.topk", "index_topk")
    f.read_int("hyper_connections.mult", "hc_mult")
    f.read_int("hyper_connections.sinkhorn_iters", "hc_sinkhorn_iters")
    f.read_float("hyper_connections.eps", "hc_eps")
    f.read_int("moe.experts", "n_routed_experts")
    f.read_int("moe.experts_per_token", "num_experts_per_tok")
    if f.read_int("moe.shared_experts", "n_shared_experts", 0) > 1:
        raise HfConfigError(f"n_shared_experts: {config['n_shared_experts']}; b12x supports 0 or 1 shared expert")
    f.read_int("moe.intermediate_size", "moe_intermediate_size")
    _hash_layers(f, f.values["num_layers"])
    f.set("moe.scoring", _choice(_required(config, "scoring_func"), "scoring_func", SCORING), "scoring_func")
    f.read_float("moe.routed_scaling_factor", "routed_scaling_factor")
    f.read_float("moe.swiglu_limit", "swiglu_limit")
    if v41:
        _csa2(f, layers)
        _dspark(f, layers, stages)
    else:
        f.set("draft.stages", stages, "num_nextn_predict_layers")
    return f.values, f.sources


def engram_section(config: dict) -> dict[str, Any] | None:
    """The recipe's `model.engram` for a DeepSeek V4.1 config.json with Engram layers, or None
    for a config without any Engram key.

    The token map is `tokenizer`: DeepSeek's compressed ids come from the checkpoint's
    tokenizer.json. When the config states `engram_num_embeddings`, each layer's table rows,
    it must be the sum of that layer's primes (exporter/model/engram_hashing.py), or the
    hashes the exporter rebuilds would index another table than the checkpoint's.
    """
    keys = [ENGRAM_IDS, ENGRAM_ROWS, *(key for _, key, _ in ENGRAM_KEYS)]
    given = [key for key in keys if _given(config, key)]
    if not given:
        return None
    why = f"; the config has Engram keys ({given[0]})"
    ids = _list(_required(config, ENGRAM_IDS, why), ENGRAM_IDS)
    section: dict[str, Any] = {"layer_ids": [_int(v, f"{ENGRAM_IDS}[{i}]", 0) for i, v in enumerate(ids)]}
    if not ids or section["layer_ids"] != sorted(set(section["layer_ids"])):
        raise HfConfigError(f"{ENGRAM_IDS}: {ids!r}; expected distinct layer ids in increasing order")
    for field, key, minimum in ENGRAM_KEYS:
        section[field] = _int(_required(config, key, why), key, minimum)
    if section["head_dim"] % 32:
        raise HfConfigError(f"engram_head_dim: {section['head_dim']} is not a multiple of 32 (the tables' scale blocks)")
    section["token_map"] = "tokenizer"
    if _given(config, ENGRAM_ROWS):
        _check_engram_rows(config[ENGRAM_ROWS], section)
    return section


def _check_engram_rows(rows: Any, e: dict[str, Any]) -> None:
    from b12x_toolchain.exporter.model.engram_hashing import layer_primes

    rows = _list(rows, ENGRAM_ROWS)
    if len(rows) != len(e["layer_ids"]):
        raise HfConfigError(f"{ENGRAM_ROWS}: has {len(rows)} entries; {ENGRAM_IDS} names {len(e['layer_ids'])} layers")
    primes = layer_primes(e["prime_search_start"], e["layer_ids"], e["max_ngram"] - 1, e["heads_per_order"])
    for i, (layer, given) in enumerate(zip(e["layer_ids"], rows)):
        expected = sum(primes[layer])
        if _int(given, f"{ENGRAM_ROWS}[{i}]") != expected:
            raise HfConfigError(f"{ENGRAM_ROWS}[{i}]: layer {layer}'s table has {given} rows; the sum of its "
                                f"{len(primes[layer])} primes from engram_vocab_size {e['prime_search_start']} "
                                f"is {expected}")


def tied_embeddings(config: dict) -> bool:
    """Whether lm_head shares the embedding matrix (then checkpoints store it once)."""
    tied = config.get("tie_word_embeddings", False)  # transformers' default for V4
    if not isinstance(tied, bool):
        raise HfConfigError(f"tie_word_embeddings: {tied!r} is not true or false")
    return tied


# --- the recipe document ------------------------------------------------------------

def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


def recipe_name(config_path) -> str:
    """A recipe name from the checkpoint directory's name: `DeepSeek-V4-Flash` -> `deepseek-v4-flash`."""
    path = Path(config_path).resolve()
    folder = path.parent.name if path.name == CONFIG or path.is_file() else path.name
    name = re.sub(r"[^a-z0-9._-]+", "-", folder.lower()).strip("-._")
    return name or "from-hf"


def recipe_from_hf_config(config: dict, template=None, name: str = "from-hf", *,
                          max_seq_len: int | None = None) -> dict[str, Any]:
    """A recipe document (plain data, YAML-dumpable) for a DeepSeek V4 or V4.1 config.json:
    a `deepseek_v4` recipe, or a `deepseek_v41` one for a V4.1 config (`is_v41`).

    The model comes from `config`; max_seq_len (unless given), init_seed, the cache, the
    passes and the rewrites come from `template` (a Recipe or a recipe document of the same
    family; the bundled dsv4-tiny or dsv41-tiny by default). fuse_window_snapshot's expected
    matches follow the new layer count: one window snapshot site per target layer in
    verify, and per draft stage in draft (none for V4's MTP stage). A V4.1 config's
    `dspark_block_size` is the draft pass's width (verify's is one more), its DSpark
    confidence threshold the template's, and its Engram keys give model.engram
    (`engram_section`). A V4 config with Engram keys is refused rather than written
    without them. A quantized config (`quantization_config`) gives the `weights` section
    (quantization.py).
    """
    from b12x_toolchain.exporter.hf.quantization import weights_section
    from b12x_toolchain.exporter.recipe.loader import Recipe, load_recipe
    from b12x_toolchain.exporter.recipe.schema import DSparkSpec, V4ModelSpec, V41ModelSpec

    v41 = is_v41(config)
    family = V41_TYPE if v41 else "deepseek_v4"
    if template is None:
        template = load_recipe("dsv41-tiny" if v41 else "dsv4-tiny")
    if not isinstance(template, Recipe):
        template = Recipe.model_validate(template)
    if template.model.family != family:
        raise HfConfigError(f"{_family_source(config)}: the config is {family}'s, but template recipe "
                            f"{template.name!r} is {template.model.family}'s (its cache formats and passes are "
                            "another family's)")
    base = template.model_dump(mode="json")
    flat, sources = model_fields(config)
    engram = engram_section(config)
    if engram is not None and not v41:
        raise HfConfigError(f"{ENGRAM_IDS}: the config has Engram layers {engram['layer_ids']}, but none of DeepSeek "
                            f"V4.1's keys ({', '.join(V41_KEYS[:2])}, dspark_* ...); a deepseek_v4 recipe has no "
                            "Engram, and only a V4.1 config gives a deepseek_v41 recipe, whose model.engram holds them")
    weights = weights_section(config)
    model = _nest(flat)
    model["max_seq_len"] = base["model"]["max_seq_len"] if max_seq_len is None else max_seq_len
    model["init_seed"] = base["model"]["init_seed"]
    passes = copy.deepcopy(base["passes"])
    if v41:
        model["draft"]["confidence_threshold"] = base["model"]["draft"]["confidence_threshold"]
        model["draft"] = {key: model["draft"][key] for key in DSparkSpec.model_fields if key in model["draft"]}
        if engram is not None:
            model["engram"] = engram
            sources.update({"engram.layer_ids": ENGRAM_IDS, **{f"engram.{f}": key for f, key, _ in ENGRAM_KEYS}})
        block = dspark_block_size(config)
        passes["draft"]["width"], passes["verify"]["width"] = block, block + 1
    spec = V41ModelSpec if v41 else V4ModelSpec
    ordered = {key: model[key] for key in spec.model_fields if key in model}  # schema order reads best
    if v41:
        _check_model(ordered, sources)
    rewrites = copy.deepcopy(base["rewrites"])
    for rewrite in rewrites:
        if rewrite["name"] == "fuse_window_snapshot":
            rewrite["expect_matches"].update(verify=flat["num_layers"], draft=flat["draft.stages"] if v41 else 0)
    doc = {"recipe_version": 1, "name": name, "model": ordered, "cache": base["cache"],
           "passes": passes, "rewrites": rewrites}
    if weights is not None:
        doc["weights"] = weights
    return doc


def _check_model(model: dict[str, Any], sources: dict[str, str]) -> None:
    """The V4.1 model section's own checks (CSA2's roles, ids in range), each problem named by
    the config key its field came from; a problem with a field no key gave is left to the
    recipe's loader, which names the field."""
    from pydantic import ValidationError

    from b12x_toolchain.exporter.recipe.schema import V41ModelSpec

    try:
        V41ModelSpec.model_validate(model)
    except ValidationError as exc:
        for error in exc.errors():
            path = [str(part) for part in (*error["loc"], *(error.get("ctx") or {}).get("path", ()))]
            for end in range(len(path), 0, -1):
                source = sources.get(".".join(path[:end]))
                if source:
                    detail = (error.get("ctx") or {}).get("detail") or error["msg"]
                    raise HfConfigError(f"{source}: {detail} (model.{'.'.join(path)})") from None
