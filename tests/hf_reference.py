"""A tiny DeepSeek V4 checkpoint written by Hugging Face `transformers`, matching dsv4-tiny.

`save_tiny_checkpoint` writes what a real V4 checkpoint directory holds: config.json,
safetensors shards with `model.safetensors.index.json`, and the MTP stage's tensors
(`mtp.0.*`), which real checkpoints ship but `transformers` neither loads nor saves.
The weights are `init_weights` (every tensor non-trivial, unlike the `transformers`
init with its zero sinks and routing tables), so a test comparing logits against the
`transformers` model exercises all of them.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
import transformers

from b12x_toolchain.exporter.model.weights import init_weights
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from decode_steps import FP32_WEIGHTS, SMALL_V4

INDEX = "model.safetensors.index.json"
MTP_SHARD = "model-mtp.safetensors"
# An MTP stage's own tensors; the rest of `mtp.0.*` is one decoder layer.
MTP_OWN = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight", "norm.weight",
           "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale")

# recipes/dsv4-tiny.yaml, in transformers' terms
TINY = dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64, partial_rotary_factor=16 / 64,
    q_lora_rank=32, o_groups=2, o_lora_rank=16,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    index_n_heads=8, index_head_dim=32, index_topk=4, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    sliding_window=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0, num_nextn_predict_layers=1,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64},
    # max_position_embeddings only feeds YaRN's attention factor, which V4 pins to 1.0;
    # matching the recipe's max_seq_len keeps transformers from warning about it.
    max_position_embeddings=1024,
)


# decode_steps.SMALL_V4's two target layers in transformers' terms
SMALL = dict(num_hidden_layers=2, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
             mlp_layer_types=["hash_moe", "moe"])


def tiny_v4_config(**changes) -> transformers.DeepseekV4Config:
    return transformers.DeepseekV4Config(**{**TINY, **changes})


def small_v4_config(**changes) -> transformers.DeepseekV4Config:
    return tiny_v4_config(**SMALL, **changes)


def small_v4_recipe(changes: dict | None = None, name: str = "dsv4-small"):
    """dsv4-tiny cut to SMALL_V4, with `changes` on top."""
    return recipe_variant(load_recipe("dsv4-tiny"), {**SMALL_V4, **(changes or {})}, name=name)


def fp32_tiny_recipe(small: bool = False):
    """dsv4-tiny (or its SMALL_V4 cut) with every weight fp32 (the bundled recipe stores V4
    Instruct's formats): the model transformers holds, and what `recipe from-hf` writes, which
    has no `weights` section."""
    return small_v4_recipe(FP32_WEIGHTS) if small else recipe_variant(load_recipe("dsv4-tiny"), FP32_WEIGHTS)


def tiny_weights(seed: int, small: bool = False) -> dict[str, torch.Tensor]:
    """Every weight of dsv4-tiny (or its SMALL_V4 cut) in fp32, target and MTP, by state-dict name."""
    return init_weights(Dims.from_recipe(fp32_tiny_recipe(small)), seed)


@dataclass
class TinyCheckpoint:
    path: Path
    model: transformers.DeepseekV4ForCausalLM  # holds `weights`' target tensors, in eval mode
    weights: dict[str, torch.Tensor]  # every weight weight_specs names, target and MTP


def _mtp_tensors(weights: dict[str, torch.Tensor], original_format: bool) -> dict[str, torch.Tensor]:
    """The MTP stage as a checkpoint stores it.

    In the release's layout its decoder layer is named like a target layer's
    (`mtp.0.attn.wq_a.weight`, one tensor per routed expert): a one-layer model of the
    same kind (window-only, routed) holding those weights is saved by transformers, and
    its layer renamed. The head keeps DeepSeek's flat names (`mtp.0.hc_head_fn`).
    """
    mtp = {name[len("mtp.0."):]: t for name, t in weights.items() if name.startswith("mtp.0.")}
    if not original_format:
        return {f"mtp.0.{name}": t for name, t in mtp.items()}
    out = {f"mtp.0.{name.replace('hc_head.hc_', 'hc_head_')}": mtp[name] for name in MTP_OWN}
    layer = transformers.DeepseekV4ForCausalLM(tiny_v4_config(
        num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"]))
    layer.load_state_dict({f"model.layers.0.{k}": t for k, t in mtp.items() if k not in MTP_OWN}, strict=False)
    with tempfile.TemporaryDirectory() as tmp:
        layer.save_pretrained(tmp)
        saved = safetensors.torch.load_file(str(Path(tmp) / "model.safetensors"))
    prefix = "model.layers.0."
    out.update({"mtp.0." + k[len(prefix):]: t for k, t in saved.items() if k.startswith(prefix)})
    return out


def save_tiny_checkpoint(directory, seed: int = 0, *, original_format: bool = True,
                         small: bool = False) -> TinyCheckpoint:
    """Write the checkpoint into `directory` in a few shards plus the index.

    original_format: the names transformers' save_pretrained writes by default (DeepSeek's
    release layout); False: state-dict names, as `save_original_format=False` writes them.
    small: the SMALL_V4 cut (one CSA and one HCA layer) instead of dsv4-tiny's four layers.
    """
    directory = Path(directory)
    torch.manual_seed(seed)  # the transformers init is overwritten, but keep it reproducible anyway
    model = transformers.DeepseekV4ForCausalLM(small_v4_config() if small else tiny_v4_config()).eval()
    weights = tiny_weights(seed, small)
    model.load_state_dict({k: t for k, t in weights.items() if not k.startswith("mtp.")}, strict=True)
    # Small shards, so the import reads an index and more than one file.
    model.save_pretrained(directory, max_shard_size="1MB", save_original_format=original_format)
    mtp = _mtp_tensors(weights, original_format)
    safetensors.torch.save_file(mtp, str(directory / MTP_SHARD), metadata={"format": "pt"})
    index = json.loads((directory / INDEX).read_text())
    index["weight_map"].update({name: MTP_SHARD for name in mtp})
    index["metadata"]["total_size"] = index["metadata"].get("total_size", 0) + sum(t.nbytes for t in mtp.values())
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return TinyCheckpoint(directory, model, weights)


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """One full forward, no cache: [len(tokens), vocab]."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]
