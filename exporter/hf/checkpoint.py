"""Import a Hugging Face DeepSeek V4 checkpoint directory as a recipe's weights.

The directory is what `save_pretrained` writes (config.json, safetensors shards and
`model.safetensors.index.json`, or one `model.safetensors`) plus the MTP stage under
`mtp.{s}.`, which real V4 checkpoints ship and `transformers` does not load. Only JSON
and safetensors are read, so nothing in the directory is ever executed.

Tensors may be named as DeepSeek's release names them (what `save_pretrained` writes by
default, one tensor per routed expert) or as `state_dict()` does; `hf_names` maps them.
Import is all or nothing: config.json must describe the recipe's model, and the shards
must hold exactly the weights `weight_specs` names, once each, with the recipe's shape
and dtype. A problem is a `CheckpointError` naming the tensor or config key, what the recipe
expects and what the checkpoint has.

A quantized checkpoint (config.json's `quantization_config`), or any checkpoint for a
recipe whose `weights` section stores some weight in another format than fp32, is read
in its stored formats by release_reader.py (the layout: release_layout.py): each weight
must be stored in the format the recipe gives it (FP8 data with its block scales, packed
FP4 experts, BF16), and comes back as the package stores it, data under the weight's name
and scale under `<name>_scale`.

A `deepseek_v41` recipe's checkpoint is always read so. Its config.json is checked for
its Engram keys only (`engram_section`; the other V4.1 keys are not read yet, and every
weight's shape and format is checked instead). Engram's tensors are read under the
release's names (`layers.{i}.engram.embed.weight` with its F8_E8M0 `.scale`, kept as
stored) or b12x's; a table whose rows are not the sum of its layer's primes is refused
before anything is read. The token map is the checkpoint's `model.engram.token_map` when
it holds one (checked), else made as the recipe's `token_map` says: from the directory's
tokenizer.json (`tokenizer`) or id mod compressed_vocab_size (`identity`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from b12x_toolchain.exporter.hf.config import CONFIG, HfConfigError, model_fields, read_config, tied_embeddings
from b12x_toolchain.exporter.hf.config_engram import engram_section
from b12x_toolchain.exporter.hf.config_rope import YARN_KEYS
from b12x_toolchain.exporter.hf.names import Target, computed_table, target_of
from b12x_toolchain.exporter.hf.release_layout import INT64
from b12x_toolchain.exporter.hf.release_reader import read_release_checkpoint
from b12x_toolchain.exporter.model.engram import TOKEN_MAP
from b12x_toolchain.exporter.model.engram_token_map import check_token_map, compressed_token_map, identity_token_map
from b12x_toolchain.exporter.model.weight_roles import role_of, weight_role
from b12x_toolchain.exporter.model.weights import (
    EMBED,
    LM_HEAD,
    SCALE_SUFFIX,
    logical_specs,
    weight_formats,
    weight_specs,
)
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.formats.weight_formats import FP32
from b12x_toolchain.runtime.package.checkpoint import CheckpointError, read_checkpoint, weight_map

__all__ = ["checkpoint_source", "load_hf_checkpoint"]

TOKENIZER = "tokenizer.json"
# config.json's Engram fields (engram_section) against the recipe's (EngramDims), with the key each comes from.
ENGRAM_CHECKED = (("layer_ids", "layer_ids", "engram_layer_ids"), ("max_ngram", "max_ngram", "engram_max_ngram_size"),
                  ("heads_per_order", "heads", "engram_n_heads"), ("head_dim", "head_dim", "engram_head_dim"),
                  ("prime_search_start", "prime_start", "engram_vocab_size"),
                  ("compressed_vocab_size", "compressed_vocab", "engram_compressed_vocab_size"),
                  ("pad_id", "pad_id", "engram_pad_token_id"))


def _recipe_fields(d: Dims) -> dict:
    """The recipe's model fields as `model_fields` writes them (dotted paths), from Dims."""
    v, m = d, d.moe
    return {
        "family": d.family, "vocab_size": d.vocab, "hidden_size": d.hidden, "num_layers": d.layers,
        "num_heads": d.heads, "head_dim": d.head_dim, "rope_head_dim": d.rope_dim,
        "q_lora_rank": v.q_lora_rank, "o_groups": v.o_groups, "o_lora_rank": v.o_lora_rank,
        "compress_ratios": [*d.ratios, *[0] * d.draft_stages], "csa_ratio": v.csa_ratio, "hca_ratio": v.hca_ratio,
        "window": d.window, "rms_norm_eps": d.eps, "rope_theta": d.rope_theta,
        "compress_rope_theta": d.compress_rope_theta,
        "yarn": None if v.yarn is None else dict(zip(YARN_KEYS, v.yarn)),
        "indexer.heads": v.index_heads, "indexer.head_dim": v.index_head_dim, "indexer.topk": v.index_topk,
        "hyper_connections.mult": v.hc_mult, "hyper_connections.sinkhorn_iters": v.hc_iters,
        "hyper_connections.eps": v.hc_eps,
        "moe.experts": m.experts, "moe.experts_per_token": m.experts_per_token,
        "moe.shared_experts": m.shared_experts, "moe.intermediate_size": m.intermediate,
        "moe.hash_layers": m.hash_layers, "moe.scoring": m.scoring,
        "moe.routed_scaling_factor": m.routed_scaling, "moe.swiglu_limit": m.swiglu_limit,
        "draft.stages": d.draft_stages,
    }


def _check_config(config: dict, d: Dims) -> bool:
    """Refuse a config.json that describes another model; returns whether lm_head is tied."""
    try:
        fields, sources = model_fields(config)
        tied = tied_embeddings(config)
    except HfConfigError as exc:
        raise CheckpointError(f"{CONFIG}: {exc}") from None
    recipe = _recipe_fields(d)
    for path, value in fields.items():
        if value != recipe[path]:
            raise CheckpointError(f"{CONFIG}: {sources[path]} gives model.{path} = {value}, but the recipe's is "
                                  f"{recipe[path]}")
    return tied


def _plan(stored: dict[str, Path], specs: dict, experts: int) -> tuple[dict[str, dict], list[str]]:
    """Stored tensors grouped by the weight they hold (weight -> {(expert, part): stored name}),
    and the stored names that hold no weight of the recipe."""
    plan: dict[str, dict] = {}
    extra = []
    for name in sorted(stored):
        target = target_of(name)
        if target.name not in specs or (target.expert is not None and target.expert >= experts):
            if not computed_table(name):
                extra.append(name)
            continue
        held = plan.setdefault(target.name, {})
        key = (target.expert, target.part)
        if key in held:
            raise CheckpointError(f"{name}: holds the same weight as {held[key]} ({target.describe()})")
        if held and (key == (None, 0)) != ((None, 0) in held):
            other = next(iter(held.values()))
            raise CheckpointError(f"{name}: {target.name} is stored both whole and per routed expert ({other})")
        held[key] = name
    return plan, extra


def _missing(piece: str, dtype: str, shape: tuple) -> CheckpointError:
    hint = "; it is the MTP stage's, which save_pretrained leaves out" if piece.startswith("mtp.") else ""
    return CheckpointError(f"{piece}: not in the checkpoint; the recipe expects {dtype} {list(shape)}{hint}")


def _expected(plan: dict[str, dict], specs: dict, experts: int, tied: bool) -> dict[str, tuple]:
    """Stored name -> (dtype, shape) the recipe expects of it; refuses a weight not stored in full."""
    expected = {}
    for weight, (shape, dtype) in specs.items():
        held = plan.get(weight)
        if held is None:
            if weight == LM_HEAD and tied:
                continue  # stored once, as the embedding
            raise _missing(weight, dtype, shape)
        if (None, 0) in held:
            expected[held[(None, 0)]] = (dtype, shape)
            continue
        # Per routed expert: each holds one expert's rows (both halves of gate_up_proj).
        parts = weight_role(weight).parts
        piece_shape = (shape[1] // parts, *shape[2:])
        for key in [(e, p) for e in range(experts) for p in range(parts)]:
            if key not in held:
                raise _missing(Target(weight, *key).describe(), dtype, piece_shape)
            expected[held[key]] = (dtype, piece_shape)
    return expected


def _read(root: Path, expected: dict[str, tuple]) -> dict[str, torch.Tensor]:
    try:
        return read_checkpoint(root, expected, whose="recipe's")
    except CheckpointError as exc:
        # The message starts with the stored name; add the weight it holds when that is named otherwise.
        stored = str(exc).partition(":")[0]
        target = target_of(stored)
        if stored in expected and (target.name != stored or target.expert is not None):
            raise CheckpointError(f"{exc} (it holds {target.describe()})") from None
        raise


def _assemble(held: dict, tensors: dict[str, torch.Tensor], experts: int) -> torch.Tensor:
    if (None, 0) in held:
        return tensors[held[(None, 0)]]
    parts = sorted({part for _, part in held})
    # gate_up_proj: [experts, gate rows | up rows, hidden]; down_proj: [experts, hidden, rows]
    return torch.cat([torch.stack([tensors[held[(e, p)]] for e in range(experts)]) for p in parts], dim=1)


def load_hf_checkpoint(directory, d: Dims) -> dict[str, torch.Tensor]:
    """Every weight `weight_specs(d)` names, read from a Hugging Face checkpoint directory."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    try:
        config = read_config(root / CONFIG)
    except HfConfigError as exc:  # names the file already
        raise CheckpointError(str(exc)) from None
    if not d.v4:
        _check_engram_config(config, d)
        return _load_native(root, d)
    tied = _check_config(config, d)
    if weight_formats(d) or "quantization_config" in config:
        return _load_native(root, d)
    specs = weight_specs(d)
    experts = d.moe.experts
    plan, extra = _plan(weight_map(root), specs, experts)
    expected = _expected(plan, specs, experts, tied)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{extra[0]}: in the checkpoint but not a weight of the recipe's model{more}")
    tensors = _read(root, expected)
    out = {weight: _assemble(plan[weight], tensors, experts) for weight in specs if weight in plan}
    if tied:
        if LM_HEAD in out and not torch.equal(out[LM_HEAD], out[EMBED]):
            raise CheckpointError(f"{LM_HEAD}: differs from {EMBED}, but config.json sets tie_word_embeddings")
        # A copy: safetensors refuses to write two names sharing one storage.
        out[LM_HEAD] = out[EMBED].clone()
    return {name: out[name] for name in specs}


def _load_native(root: Path, d: Dims) -> dict[str, torch.Tensor]:
    """A checkpoint in the formats it ships (release_layout.py): every weight as the recipe stores
    it, data and scale, nothing decoded; a tensor in another format is refused by name."""
    logical, formats = logical_specs(d), weight_formats(d)
    shapes = {name: shape for name, (shape, _) in logical.items()}
    # The recipe's formats as they are; a weight without one is fp32, and the integer
    # routing table is expected by its dtype, having no format.
    expected = {name: INT64 if dtype == INT64 else formats.get(name, FP32) for name, (_, dtype) in logical.items()}
    out = {}
    if d.engram is not None:
        stored = weight_map(root)
        _check_engram_rows(stored, shapes, d)
        if not any(target_of(name).name == TOKEN_MAP for name in stored):  # made, not read
            del expected[TOKEN_MAP], shapes[TOKEN_MAP]
            out[TOKEN_MAP] = _token_map(root, d)
    checkpoint = read_release_checkpoint(root, expected, shapes)
    for name in shapes:
        tensor = checkpoint.stacked(name)
        out[name] = tensor.data
        if tensor.scale is not None:
            out[name + SCALE_SUFFIX] = tensor.scale
    if d.engram is not None:
        try:
            check_token_map(out[TOKEN_MAP], d.vocab, d.engram.compressed_vocab)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
    return {name: out[name] for name in weight_specs(d)}


def _check_engram_config(config: dict, d: Dims) -> None:
    """config.json's Engram keys must give the recipe's model.engram (or both have none)."""
    try:
        given = engram_section(config)
    except HfConfigError as exc:
        raise CheckpointError(f"{CONFIG}: {exc}") from None
    e = d.engram
    if (given is None) != (e is None):
        raise CheckpointError(f"{CONFIG}: " + ("has no Engram keys (engram_layer_ids ...), but the recipe has Engram "
                                               f"layers {list(e.layer_ids)}" if given is None else
                                               f"engram_layer_ids gives Engram layers {given['layer_ids']}, but the "
                                               "recipe has no model.engram"))
    for field, attr, key in ENGRAM_CHECKED if e is not None else ():
        recipe = list(getattr(e, attr)) if field == "layer_ids" else getattr(e, attr)
        if given[field] != recipe:
            raise CheckpointError(f"{CONFIG}: {key} gives model.engram.{field} = {given[field]}, but the recipe's is "
                                  f"{recipe}")


def _check_engram_rows(stored: dict[str, Path], shapes: dict, d: Dims) -> None:
    """Each Engram table has one row per value of its layer's primes; another count is refused by
    the stored tensor's name, from its header alone."""
    for name, path in sorted(stored.items()):
        weight = target_of(name).name
        if role_of(weight) != "engram_tables" or weight not in shapes:
            continue
        with safe_open(str(path), framework="pt") as handle:
            got = handle.get_slice(name).get_shape()
        rows = shapes[weight][0]
        if not got or got[0] != rows:
            layer = weight.removeprefix("model.layers.").partition(".")[0]
            raise CheckpointError(f"{name}: the Engram table has {got[0] if got else 0} rows; layer {layer}'s "
                                  f"{d.engram.columns} primes from {d.engram.prime_start} sum to {rows}, "
                                  f"so {rows} rows are expected")


def _token_map(root: Path, d: Dims) -> torch.Tensor:
    """The token map the recipe's `token_map` says, for a checkpoint that holds none."""
    e = d.engram
    if e.token_map == "identity":
        return identity_token_map(d.vocab, e.compressed_vocab)
    path = root / TOKENIZER
    if not path.is_file():
        raise CheckpointError(f"{TOKENIZER}: not in the checkpoint, and it holds no {TOKEN_MAP}; the recipe's "
                              "engram token_map is 'tokenizer', which derives the map from it")
    try:
        return compressed_token_map(path, d.vocab, e.compressed_vocab, pad_id=e.pad_id)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def checkpoint_source(directory) -> str:
    """The package's record of where its weights came from: the directory's name, not
    its path, so the same checkpoint exports the same bytes wherever it lies."""
    return f"Hugging Face checkpoint {Path(directory).resolve().name}"
