"""Tensor names of a DeepSeek V4 checkpoint on disk -> the names b12x's V4 weights use.

b12x names V4 weights as `DeepseekV4ForCausalLM.state_dict()` does. Checkpoints on disk
do not: DeepSeek's release uses its own names (`layers.3.attn.wq_a.weight`, one tensor
per routed expert, `embed.weight`, `head.weight`), and `transformers`' `save_pretrained`
writes those same names back, with `model.` in front of the base model's. `transformers`
maps them on load with a rename table; the renames below are that table (its
`deepseek_v4` entry of `conversion_mapping.py`) in the same order, so a name is read as
`transformers` reads it. Names already in state-dict form pass through unchanged.

The MTP stage (`mtp.{s}.`), which `transformers` never loads, uses the same block names
plus its own head and input projections, and is mapped the same way.

DeepSeek V4.1's Engram tensors (`layers.{i}.engram.{embed, wkv}.weight` with their
`.scale`, `layers.{i}.engram.{q_weight, k_weight}`) keep their names under the block:
`transformers` has no V4.1 table, and the attention renames (`.wkv.` -> `.kv_proj.`) are
not theirs.

Scales: the release names a block scale `<module>.scale` beside `<module>.weight`, and
`<tensor>_scale_inv` beside a merged tensor (`experts.gate_up_proj_scale_inv`);
`transformers` renames `.scale` to `.weight_scale_inv`, and b12x writes `.weight_scale`.
`release_scale_name` gives the release's name, `scale_owner` reads any of them back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from b12x_toolchain.exporter.model.weight_roles import weight_role

__all__ = ["Target", "computed_table", "release_scale_name", "scale_owner", "target_of"]

# (pattern, replacement) on ".<name within a block>", applied in order, each at most once.
BLOCK_RENAMES = tuple((re.compile(p), r) for p, r in (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
))
# One tensor per routed expert: w1 (gate) and w3 (up) are stacked over experts and
# concatenated along rows into gate_up_proj, w2 stacked into down_proj.
EXPERT = re.compile(r"^\.mlp\.experts\.(\d+)\.w([123])\.weight$")
EXPERT_PARTS = {"1": ("gate_up_proj", 0), "3": ("gate_up_proj", 1), "2": ("down_proj", 0)}
BLOCK = re.compile(r"^(?:model\.)?(layers|mtp)\.(\d+)\.(.+)$")
# The base model's own tensors outside any block, by their release names and state-dict names.
TOP = {
    "embed.weight": "model.embed_tokens.weight", "embed_tokens.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "hc_head.hc_fn": "model.hc_head.hc_fn", "hc_head.hc_base": "model.hc_head.hc_base",
    "hc_head.hc_scale": "model.hc_head.hc_scale",
}
HEAD = {"head.weight": "lm_head.weight", "lm_head.weight": "lm_head.weight"}  # outside the base model
# An MTP stage's head and input projections: kept as they are, except the flat hc_head names.
MTP_OWN = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
           "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale"}

ENGRAM = "engram."  # V4.1's Engram tensors: named as the release names them


@dataclass(frozen=True)
class Target:
    """Where a stored tensor goes: the whole of `name`, or one routed expert's slice of it."""

    name: str
    expert: int | None = None
    part: int = 0  # within gate_up_proj: 0 the gate rows (w1), 1 the up rows (w3)

    def describe(self) -> str:
        """The weight, or the routed expert's rows of it, in words for an error message."""
        if self.expert is None:
            return self.name
        which = ("gate", "up")[self.part] if weight_role(self.name).gate_up else "down"
        return f"routed expert {self.expert}'s {which} rows of {self.name}"


def target_of(stored: str) -> Target:
    """The b12x weight a checkpoint tensor holds; an unknown name maps to itself."""
    if stored in HEAD:
        return Target(HEAD[stored])
    base = stored.removeprefix("model.")
    if base in TOP:
        return Target(TOP[base])
    block = BLOCK.match(stored)
    if block is None:
        return Target(stored)
    kind, index, rest = block.groups()
    prefix = f"mtp.{index}." if kind == "mtp" else f"model.layers.{index}."
    if kind == "mtp":
        rest = re.sub(r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1", rest)
        if rest in MTP_OWN:
            return Target(prefix + rest)
    if rest.startswith(ENGRAM):
        return Target(prefix + rest)
    dotted = "." + rest
    for pattern, replacement in BLOCK_RENAMES:
        dotted = pattern.sub(replacement, dotted, count=1)
    expert = EXPERT.match(dotted)
    if expert is not None:
        leaf, part = EXPERT_PARTS[expert.group(2)]
        return Target(f"{prefix}mlp.experts.{leaf}", int(expert.group(1)), part)
    return Target(prefix + dotted[1:])


def computed_table(stored: str) -> bool:
    """Whether a checkpoint tensor is a RoPE table some savers write (`inv_freq`): computed from
    config.json, it holds no weight."""
    return stored.endswith("inv_freq")


def release_scale_name(stored: str) -> str:
    """The release's name for the scale of checkpoint tensor `stored`."""
    return stored.removesuffix(".weight") + ".scale" if stored.endswith(".weight") else stored + "_scale_inv"


def scale_owner(name: str, stored: set[str]) -> str | None:
    """The data tensor checkpoint tensor `name` is the scale of, or None when it is not a scale.
    `X.scale` is a scale only beside `X.weight` (otherwise a weight, like `attn_hc.scale`)."""
    if name.endswith("_scale_inv"):  # X.weight_scale_inv, and merged experts' X_scale_inv
        return name.removesuffix("_scale_inv")
    if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in stored:
        return name.removesuffix(".scale") + ".weight"
    if name.endswith(".weight_scale") and name.removesuffix("_scale") in stored:  # b12x's own layout
        return name.removesuffix("_scale")
    return None
