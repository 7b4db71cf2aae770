"""config.json's quantization declaration, and the recipe `weights` section it stands for.

DeepSeek's V4 / V4.1 config.json declares its stored formats as

    quantization_config: {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
                          scale_fmt: ue8m0, weight_block_size: [bm, bn]}
    expert_dtype: fp4    # top level in V4, inside quantization_config in V4.1

`read_quantization` parses it (for the checkpoint reader and `recipe from-hf` alike);
`weights_section` turns it into the recipe's `weights` section by role, the roles the
release quantizes (release_layout.py's docstring, weight_roles.py's release column):
FP8 for the attention projections, the indexer query, the shared experts and the MTP
stage's input projections; routed experts per expert_dtype; BF16 for the embedding, the
head, the compressors and indexer keys, the router and the norms. V4.1's Engram layers
store their tables FP8 with one scale per 32 values of a row (1x32) and their projection
`wkv` in the linears' blocks; the section names those roles only for a config with Engram.
A declaration the recipe cannot represent is an `HfConfigError` naming the key, its value
and what is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

from b12x_toolchain.exporter.errors import HfConfigError
from b12x_toolchain.exporter.model.weight_roles import ROLES
from b12x_toolchain.runtime.formats.weight_formats import BF16, FP4_E2M1, WeightFormat, format_problem

__all__ = ["Quantization", "read_quantization", "release_role_formats", "weights_section"]

QUANT = "quantization_config"
FP8_ROLES = ("attention", "indexer_query", "shared_experts", "draft_input")
BF16_ROLES = ("embeddings", "head", "compressor", "router", "norms")
ENGRAM_ROLES = ("engram_tables", "engram_projection")
ENGRAM_TABLE_BLOCK = (1, 32)  # a row is read alone: one scale per 32 of its values
# draft_heads (DSpark's) are in no DeepSeek release; the section leaves them fp32.
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default when weight_block_size is absent


@dataclass(frozen=True)
class Quantization:
    """config.json's `quantization_config` and `expert_dtype`, as the checkpoint declares them."""

    method: str
    block: tuple[int, int] | None
    scale_encoding: str  # "ue8m0", or "fp32" when scale_fmt is absent or "float"
    expert_dtype: str  # "fp4", or "fp8" when absent
    activation_scheme: str | None
    expert_dtype_key: str | None = None  # where expert_dtype was declared; None: absent


def read_quantization(config: dict) -> Quantization | None:
    """The checkpoint's declared quantization, or None for an unquantized one."""
    q = config.get(QUANT)
    if q is None:
        return None
    if not isinstance(q, dict):
        raise HfConfigError(f"{QUANT}: a {type(q).__name__}; expected an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise HfConfigError(f"{QUANT}.quant_method: {method!r} is not DeepSeek's 'fp8'")
    if q.get("fmt", "e4m3") != "e4m3":
        raise HfConfigError(f"{QUANT}.fmt: {q['fmt']!r} is not 'e4m3'")
    block = q.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
            raise HfConfigError(f"{QUANT}.weight_block_size: {block!r} is not two positive integers")
        block = tuple(block)
    scale_fmt = q.get("scale_fmt", "float")
    if scale_fmt not in ("ue8m0", "float"):
        raise HfConfigError(f"{QUANT}.scale_fmt: {scale_fmt!r} is not 'ue8m0' or 'float'")
    # V4 declares expert_dtype at the top level, V4.1 inside quantization_config.
    inside, outside = q.get("expert_dtype"), config.get("expert_dtype")
    if inside is not None and outside is not None and inside != outside:
        raise HfConfigError(f"{QUANT}.expert_dtype: {inside!r} disagrees with expert_dtype {outside!r}")
    key = f"{QUANT}.expert_dtype" if inside is not None else ("expert_dtype" if outside is not None else None)
    expert_dtype = inside or outside or "fp8"
    if expert_dtype not in ("fp4", "fp8"):
        raise HfConfigError(f"{key}: {expert_dtype!r} is not 'fp4' or 'fp8'")
    return Quantization("fp8", block, "ue8m0" if scale_fmt == "ue8m0" else "fp32", expert_dtype,
                        q.get("activation_scheme"), key)


def release_role_formats(block: tuple[int, int], scale_encoding: str, experts: str) -> dict[str, WeightFormat]:
    """role -> format of the release's scheme: FP8 linears in `block` with `scale_encoding`
    scales, routed experts fp4 (Instruct) or fp8 like the linears (Base), the rest BF16.
    Roles left out stay fp32."""
    linear = WeightFormat("fp8_e4m3", block, scale_encoding)
    out = {role: linear for role in FP8_ROLES}
    out["engram_tables"] = WeightFormat("fp8_e4m3", ENGRAM_TABLE_BLOCK, scale_encoding)
    out["engram_projection"] = linear
    out["routed_experts"] = FP4_E2M1 if experts == "fp4" else linear
    out.update({role: BF16 for role in BF16_ROLES})
    return out


def _recipe_entry(fmt: WeightFormat):
    """A format as the recipe writes it: `bf16`, `fp4_e2m1` (its one block and scale implied),
    or {format, block, scale}."""
    if fmt.kind in ("bf16", "fp4_e2m1"):
        return fmt.kind
    return {"format": fmt.kind, "block": list(fmt.block), "scale": fmt.scale_encoding}


def weights_section(config: dict) -> dict | None:
    """The recipe's `weights` section for a quantized config.json, or None for an unquantized one."""
    q = read_quantization(config)
    if q is None:
        return None
    if q.expert_dtype != "fp4":
        key = q.expert_dtype_key or "expert_dtype"
        value = repr(q.expert_dtype) if q.expert_dtype_key else "missing, which declares 'fp8'"
        raise HfConfigError(f"{key}: {value} (fp8_e4m3 routed experts); b12x has no routed-expert op for fp8_e4m3 "
                            f"yet, only for 'fp4' (fp4_e2m1)")
    block = q.block or DEFAULT_BLOCK
    problem = format_problem("fp8_e4m3", block, q.scale_encoding)
    if problem:
        raise HfConfigError(f"{QUANT}.weight_block_size: {problem[1]}")
    if q.activation_scheme not in (None, "dynamic"):  # absent: transformers' default, dynamic
        raise HfConfigError(f"{QUANT}.activation_scheme: {q.activation_scheme!r} is not 'dynamic'; b12x quantizes "
                            f"activations on the fly (DeepSeek's rule) or not at all, never with stored scales")
    # `dynamic` is DeepSeek's reference at inference: before every FP8/FP4 linear it quantizes the
    # input on the fly to E4M3 per token per 128 channels (act_quant), with scales rounded to powers
    # of two when scale_fmt is ue8m0 -- exactly b12x's `deepseek` rule. With float scales the
    # reference scales activations by amax / 448, which b12x does not implement; `none` then
    # computes what transformers computes from the checkpoint (decoded weights, float activations).
    activation = "deepseek" if q.scale_encoding == "ue8m0" else "none"
    formats = release_role_formats(block, q.scale_encoding, q.expert_dtype)
    if not any(key.startswith("engram_") and value is not None for key, value in config.items()):
        formats = {role: fmt for role, fmt in formats.items() if role not in ENGRAM_ROLES}
    return {"activation": activation, **{role: _recipe_entry(formats[role]) for role in ROLES if role in formats}}
