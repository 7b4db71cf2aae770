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
in its stored formats by release_layout.py: each weight must be stored in the format the
recipe gives it (FP8 data with its block scales, packed FP4 experts, BF16), and comes back
as the package stores it, data under the weight's name and scale under `<name>_scale`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from b12x_toolchain.exporter.hf.config import (
    CONFIG,
    YARN_KEYS,
    HfConfigError,
    model_fields,
    read_config,
    tied_embeddings,
)
from b12x_toolchain.exporter.hf.names import Target, target_of
from b12x_toolchain.exporter.hf.release_layout import INT64, read_release_checkpoint
from b12x_toolchain.exporter.model.weights import SCALE_SUFFIX, logical_specs, weight_formats, weight_specs
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.package.checkpoint import CheckpointError, read_checkpoint, weight_map
from b12x_toolchain.runtime.package.weight_format import FP32

__all__ = ["checkpoint_source", "load_hf_checkpoint"]

EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


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


def _stored_only(name: str) -> bool:
    # RoPE tables are computed from config.json; older savers wrote them, and they carry no weights.
    return name.endswith("inv_freq")


def _plan(stored: dict[str, Path], specs: dict, experts: int) -> tuple[dict[str, dict], list[str]]:
    """Stored tensors grouped by the weight they hold (weight -> {(expert, part): stored name}),
    and the stored names that hold no weight of the recipe."""
    plan: dict[str, dict] = {}
    extra = []
    for name in sorted(stored):
        target = target_of(name)
        if target.name not in specs or (target.expert is not None and target.expert >= experts):
            if not _stored_only(name):
                extra.append(name)
            continue
        held = plan.setdefault(target.name, {})
        key = (target.expert, target.part)
        if key in held:
            raise CheckpointError(f"{name}: holds the same weight as {held[key]} ({_describe(target)})")
        if held and (key == (None, 0)) != ((None, 0) in held):
            other = next(iter(held.values()))
            raise CheckpointError(f"{name}: {target.name} is stored both whole and per routed expert ({other})")
        held[key] = name
    return plan, extra


def _describe(target: Target) -> str:
    if target.expert is None:
        return target.name
    which = "down" if target.name.endswith("down_proj") else ("gate", "up")[target.part]
    return f"routed expert {target.expert}'s {which} rows of {target.name}"


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
        parts = (0, 1) if weight.endswith("gate_up_proj") else (0,)
        piece_shape = (shape[1] // len(parts), *shape[2:])
        for key in [(e, p) for e in range(experts) for p in parts]:
            if key not in held:
                raise _missing(_describe(Target(weight, *key)), dtype, piece_shape)
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
            raise CheckpointError(f"{exc} (it holds {_describe(target)})") from None
        raise


def _assemble(held: dict, tensors: dict[str, torch.Tensor], experts: int) -> torch.Tensor:
    if (None, 0) in held:
        return tensors[held[(None, 0)]]
    parts = sorted({part for _, part in held})
    # gate_up_proj: [experts, gate rows | up rows, hidden]; down_proj: [experts, hidden, rows]
    return torch.cat([torch.stack([tensors[held[(e, p)]] for e in range(experts)]) for p in parts], dim=1)


def load_hf_checkpoint(directory, d: Dims) -> dict[str, torch.Tensor]:
    """Every weight `weight_specs(d)` names, read from a Hugging Face checkpoint directory."""
    if not d.v4:
        raise CheckpointError(f"recipe family {d.family} has no Hugging Face checkpoint import; only deepseek_v4")
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    try:
        config = read_config(root / CONFIG)
    except HfConfigError as exc:  # names the file already
        raise CheckpointError(str(exc)) from None
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
    checkpoint = read_release_checkpoint(root, expected, shapes)
    out = {}
    for name in shapes:
        tensor = checkpoint.stacked(name)
        out[name] = tensor.data
        if tensor.scale is not None:
            out[name + SCALE_SUFFIX] = tensor.scale
    return {name: out[name] for name in weight_specs(d)}


def checkpoint_source(directory) -> str:
    """The package's record of where its weights came from: the directory's name, not
    its path, so the same checkpoint exports the same bytes wherever it lies."""
    return f"Hugging Face checkpoint {Path(directory).resolve().name}"
