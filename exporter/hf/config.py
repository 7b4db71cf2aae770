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
import re
from pathlib import Path
from typing import Any

from b12x_toolchain.exporter.errors import HfConfigError  # noqa: F401  (re-exported)
from b12x_toolchain.exporter.hf.config_engram import ENGRAM_IDS, ENGRAM_KEYS, engram_section
from b12x_toolchain.exporter.hf.config_layers import (
    dspark_block_size,
    read_csa2,
    read_dspark,
    read_hash_layers,
    read_v4_ratios,
    read_v41_ratios,
)
from b12x_toolchain.exporter.hf.config_rope import read_rope, read_rope_head_dim
from b12x_toolchain.exporter.hf.config_values import Fields, as_int, choice, has_key, required

__all__ = ["HfConfigError", "V41_KEYS", "is_v41", "model_fields", "read_config", "recipe_from_hf_config", "recipe_name",
           "tied_embeddings"]

CONFIG = "config.json"
CONFIG_LIMIT = 4 << 20  # a real V4 config is a few KB; the cap keeps a wrong file from being parsed
SCORING = ("sqrtsoftplus", "sigmoid", "softmax")
# DeepSeek V4.1's CSA2 and DSpark keys; any of them makes a config V4.1's. The candidate
# keys may be absent (no hierarchical candidates); the others are required.
V41_KEYS = ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks",
            "candidate_block_size", "dspark_block_size", "dspark_target_layer_ids", "dspark_noise_token_id",
            "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok")
V41_TYPE = "deepseek_v41"


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


def is_v41(config: dict) -> bool:
    """Whether config.json is DeepSeek V4.1's: model_type `deepseek_v41`, or any CSA2 / DSpark key."""
    return config.get("model_type") == V41_TYPE or any(has_key(config, key) for key in V41_KEYS)


def _family_source(config: dict) -> str:
    """The key that makes the config V4.1's (model_type, else its first V4.1 key), or V4's model_type."""
    if config.get("model_type") == V41_TYPE:
        return "model_type"
    return next((key for key in V41_KEYS if has_key(config, key)), "model_type")


def _unsupported(config: dict) -> None:
    """Keys whose only value b12x's V4 model implements; absent means transformers' default, which is it."""
    if required(config, "model_type") not in ("deepseek_v4", V41_TYPE):
        raise HfConfigError(f"model_type: {config['model_type']!r} is not 'deepseek_v4' or '{V41_TYPE}'")
    for key, supported, why in (
        ("num_key_value_heads", 1, "DeepSeek V4 attention shares one KV head"),
        ("hidden_act", "silu", "the experts are SwiGLU"),
        ("mlp_bias", False, "the shared expert has no biases"),
    ):
        value = config.get(key)
        if value is not None and (value != supported or type(value) is not type(supported)):
            raise HfConfigError(f"{key}: {config[key]!r} is not supported; b12x implements {supported!r} ({why})")


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
    f = Fields(config)
    f.set("family", V41_TYPE if v41 else "deepseek_v4", _family_source(config))
    for path, key in (("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                      ("num_layers", "num_hidden_layers"), ("num_heads", "num_attention_heads"),
                      ("head_dim", "head_dim")):
        f.read_int(path, key)
    rope_dim = read_rope_head_dim(f, f.values["head_dim"])
    for key in ("q_lora_rank", "o_groups", "o_lora_rank"):
        f.read_int(key, key)
    stages = as_int(required(config, "num_nextn_predict_layers"), "num_nextn_predict_layers", 0)
    if v41 and stages == 0:
        raise HfConfigError("num_nextn_predict_layers: 0; the recipe needs DSpark draft stages (mtp.0 ...), and a "
                            "checkpoint without them has none to export")
    if not v41 and stages != 1:
        need = ("the recipe needs one MTP draft stage, and a checkpoint without MTP weights has none to export"
                if stages == 0 else "b12x supports exactly one MTP draft stage")
        raise HfConfigError(f"num_nextn_predict_layers: {stages}; {need}")
    layers = f.values["num_layers"]
    (read_v41_ratios if v41 else read_v4_ratios)(f, layers, stages)
    f.read_int("window", "sliding_window")
    f.read_float("rms_norm_eps", "rms_norm_eps")
    read_rope(f, f.values["head_dim"], rope_dim)
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
    read_hash_layers(f, f.values["num_layers"])
    f.set("moe.scoring", choice(required(config, "scoring_func"), "scoring_func", SCORING), "scoring_func")
    f.read_float("moe.routed_scaling_factor", "routed_scaling_factor")
    f.read_float("moe.swiglu_limit", "swiglu_limit")
    if v41:
        read_csa2(f, layers)
        read_dspark(f, layers, stages)
    else:
        f.set("draft.stages", stages, "num_nextn_predict_layers")
    return f.values, f.sources


def tied_embeddings(config: dict) -> bool:
    """Whether lm_head shares the embedding matrix (then checkpoints store it once)."""
    tied = config.get("tie_word_embeddings", False)  # transformers' default for V4
    if not isinstance(tied, bool):
        raise HfConfigError(f"tie_word_embeddings: {tied!r} is not true or false")
    return tied


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
    from b12x_toolchain.exporter.recipe.schema import V4ModelSpec, V41ModelSpec

    v41 = is_v41(config)
    base = _template(config, template, v41).model_dump(mode="json")
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
        _v41_drafter(config, base, model, passes, engram, sources)
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


def _template(config: dict, template, v41: bool):
    """The template as a Recipe of the config's family (the bundled tiny one of it by default)."""
    from b12x_toolchain.exporter.recipe.loader import Recipe, load_recipe

    family = V41_TYPE if v41 else "deepseek_v4"
    if template is None:
        template = load_recipe("dsv41-tiny" if v41 else "dsv4-tiny")
    if not isinstance(template, Recipe):
        template = Recipe.model_validate(template)
    if template.model.family != family:
        raise HfConfigError(f"{_family_source(config)}: the config is {family}'s, but template recipe "
                            f"{template.name!r} is {template.model.family}'s (its cache formats and passes are "
                            "another family's)")
    return template


def _v41_drafter(config: dict, base: dict, model: dict, passes: dict, engram: dict | None,
                 sources: dict[str, str]) -> None:
    """A V4.1 recipe's DSpark fields, Engram section and draft / verify widths, in place."""
    from b12x_toolchain.exporter.recipe.schema import DSparkSpec

    model["draft"]["confidence_threshold"] = base["model"]["draft"]["confidence_threshold"]
    model["draft"] = {key: model["draft"][key] for key in DSparkSpec.model_fields if key in model["draft"]}
    if engram is not None:
        model["engram"] = engram
        sources.update({"engram.layer_ids": ENGRAM_IDS, **{f"engram.{f}": key for f, key, _ in ENGRAM_KEYS}})
    block = dspark_block_size(config)
    passes["draft"]["width"], passes["verify"]["width"] = block, block + 1


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
