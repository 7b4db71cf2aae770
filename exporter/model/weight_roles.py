"""Weight roles: the groups of weights a recipe's `weights` section gives one format each.

A weight's role is found from the end of its name (exporter/model/weights.py's names),
the first matching row of ROLE_SUFFIXES. The release column is what DeepSeek's V4 / V4.1
Instruct checkpoints hold.

| role            | b12x weights (end of name)                                        | formats               | release               |
|-----------------|-------------------------------------------------------------------|-----------------------|-----------------------|
| attention       | self_attn.{q_a_proj, q_b_proj, kv_proj, o_a_proj, o_b_proj}.weight | fp32 bf16 fp8         | fp8 (V4 128, V4.1 32) |
| indexer_query   | compressor.indexer.q_b_proj.weight                                | fp32 bf16 fp8         | fp8                   |
| shared_experts  | mlp.shared_experts.{gate_proj, up_proj, down_proj}.weight         | fp32 bf16 fp8         | fp8                   |
| routed_experts  | mlp.experts.{gate_up_proj, down_proj}                             | fp32 bf16 fp8 fp4     | fp4 1x32 ue8m0        |
| draft_input     | mtp.N.{e_proj, h_proj}.weight, dspark.main_proj.weight            | fp32 bf16 fp8         | fp8                   |
| head            | lm_head.weight                                                    | fp32 bf16             | bf16                  |
| embeddings      | model.embed_tokens.weight                                         | fp32 bf16             | bf16                  |
| compressor      | compressor.{kv_proj, gate_proj}.weight, compressor.indexer.{kv_proj, gate_proj, k_proj}.weight, indexer.scorer.weights_proj.weight | fp32 bf16 | bf16 |
| router          | mlp.gate.weight                                                   | fp32 bf16             | bf16                  |
| norms           | *norm.weight                                                      | fp32 bf16             | bf16                  |
| draft_heads     | dspark.markov.{embed, out.weight}, dspark.confidence.weight       | fp32 bf16             | (unpublished)         |
| engram_tables   | engram.embed.weight                                               | fp32 bf16 fp8 1x32    | fp8 1x32 ue8m0        |
| engram_projection | engram.wkv.weight                                               | fp32 bf16 fp8         | fp8 32x32 ue8m0       |

Engram's gate gains `engram.{q_weight, k_weight}` are norms. Its token map
`model.engram.token_map` stays int64, as the hash-routing table does.

Everything else stays as it is: sinks, the mHC mixers (`*_hc.*`, `hc_head.*`), the
compressors' position bias, the router's bias and DSpark's confidence bias in fp32 (as the
release keeps them), the hash-routing table `gate.tid2eid` in int64.

`weight_role` reads all a weight's name says about its storage, once: its role, the format
the recipe gives that role, and whether it holds routed experts' gate rows then up rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from b12x_toolchain.runtime.formats.weight_formats import FP32, WeightFormat

PLAIN = ("fp32", "bf16")
LINEAR = (*PLAIN, "fp8_e4m3")
ROLE_ELEMENT_TYPES = {
    "attention": LINEAR,
    "indexer_query": LINEAR,
    "shared_experts": LINEAR,
    "routed_experts": (*LINEAR, "fp4_e2m1"),
    "draft_input": LINEAR,
    "head": PLAIN,
    "embeddings": PLAIN,
    "compressor": PLAIN,
    "router": PLAIN,
    "norms": PLAIN,
    "draft_heads": PLAIN,
    "engram_tables": LINEAR,
    "engram_projection": LINEAR,
}
ROLE_BLOCKS = {"engram_tables": ((1, 32),)}  # a row is looked up alone: one scale per 32 of its values
ROLES = tuple(ROLE_ELEMENT_TYPES)
# Routed experts [E, 2I, D] (gate rows then up rows) and [E, D, I].
GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"

ROLE_SUFFIXES = (
    *((f"self_attn.{p}.weight", "attention") for p in ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj")),
    ("compressor.indexer.q_b_proj.weight", "indexer_query"),
    *((f"mlp.shared_experts.{p}.weight", "shared_experts") for p in ("gate_proj", "up_proj", "down_proj")),
    (GATE_UP, "routed_experts"),
    (DOWN, "routed_experts"),
    (".e_proj.weight", "draft_input"),
    (".h_proj.weight", "draft_input"),
    ("dspark.main_proj.weight", "draft_input"),
    ("lm_head.weight", "head"),
    ("model.embed_tokens.weight", "embeddings"),
    ("compressor.kv_proj.weight", "compressor"),
    ("compressor.gate_proj.weight", "compressor"),
    ("compressor.indexer.kv_proj.weight", "compressor"),
    ("compressor.indexer.gate_proj.weight", "compressor"),
    ("compressor.indexer.k_proj.weight", "compressor"),
    ("indexer.scorer.weights_proj.weight", "compressor"),
    ("mlp.gate.weight", "router"),
    ("norm.weight", "norms"),
    ("dspark.markov.embed", "draft_heads"),
    ("dspark.markov.out.weight", "draft_heads"),
    ("dspark.confidence.weight", "draft_heads"),
    ("engram.embed.weight", "engram_tables"),
    ("engram.wkv.weight", "engram_projection"),
    ("engram.q_weight", "norms"),
    ("engram.k_weight", "norms"),
)


def role_of(name: str) -> str | None:
    """The role of weight `name`, or None for a weight whose format is fixed."""
    return next((role for suffix, role in ROLE_SUFFIXES if name.endswith(suffix)), None)


@dataclass(frozen=True)
class WeightRole:
    """A weight's role (None: a weight whose format is fixed), the format the recipe gives that
    role, and whether it is routed experts' gate_up_proj: gate rows then up rows, each half its
    own tensor in a checkpoint, so a block must not straddle the two."""

    role: str | None
    format: WeightFormat = FP32
    gate_up: bool = False

    @property
    def parts(self) -> int:
        """A routed expert's pieces of this weight in a checkpoint: gate and up, or the one."""
        return 2 if self.gate_up else 1


def weight_role(name: str, role_format: Callable[[str | None], WeightFormat] = lambda role: FP32) -> WeightRole:
    """What weight `name` is, given the recipe's format of each role (fp32 for every role unless given)."""
    role = role_of(name)
    return WeightRole(role, role_format(role), name.endswith(GATE_UP))
