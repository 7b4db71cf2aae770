"""Read a DeepSeek V4 checkpoint in the formats it ships (FP8, FP4, BF16, FP32), without decoding.

DeepSeek's V4 Instruct release stores, in safetensors shards under its own names
(`layers.3.attn.wq_a.weight`, one tensor per routed expert):

- FP8 E4M3 block-scaled linears: attention `wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`, the
  indexer's `wq_b`, the shared experts' `w1`/`w2`/`w3` and the MTP stage's `e_proj` /
  `h_proj`. Weight `float8_e4m3fn [out, in]`, scale one per block under `<module>.scale`,
  grid `[ceil(out/bm), ceil(in/bn)]`: UE8M0 (`float8_e8m0fnu`, 2^(byte-127)) with 128x128
  blocks in V4 and 32x32 in V4.1; float32 in V4-Base and in V3-style checkpoints, which
  name it `<module>.weight_scale_inv`.
- FP4 E2M1 routed experts `ffn.experts.{j}.w{1,2,3}`: int8 `[out, in/2]`, two codes a byte,
  the even column in the low nibble; UE8M0 scale per 32 inputs `[out, in/32]`.
- BF16: embedding, head, norms, router weight, the compressors' and indexer's `wkv` /
  `wgate` and the indexer's `weights_proj`. FP32: sinks, mHC mixers, compressor position
  bias, router bias. The hash-routing table is an integer tensor.
- config.json: `quantization_config {quant_method: fp8, fmt: e4m3, activation_scheme:
  dynamic, scale_fmt: ue8m0, weight_block_size: [bm, bn]}`; `expert_dtype: fp4` at the top
  level (V4) or inside `quantization_config` (V4.1); quantization.py parses it.

`read_release_checkpoint` (release_reader.py) returns each weight of the recipe as a
`NativeTensor` — the bytes the checkpoint holds plus its scale — under b12x's names, after
checking it against the format the recipe expects (a `WeightFormat`, or the logical dtype
int64 of the hash-routing table, which is no stored format); anything else is a
`CheckpointError` naming the stored tensor, the expected format and what the checkpoint has.
Routed experts come per expert (`ReleaseCheckpoint.experts`); `stack_experts` merges them
into b12x's `experts.gate_up_proj` [E, 2I, D] and `experts.down_proj` [E, D, I] still
packed: gate rows (w1) then up rows (w3) per expert, scales stacked the same way, which
keeps every scale with its block as long as the block's rows divide I (always for FP4's
1x32). UE8M0 scales may be stored as F8_E8M0, uint8 (the same byte) or float32 powers of
two; all become `float8_e8m0fnu`. Only JSON and safetensors are read, one tensor at a time,
and no weight is decoded or widened to float32; only an int32 hash-routing table becomes
int64, b12x's width.

Names: the release's, `transformers`' state-dict names, and the scale keys. A tensor
`X.scale` (the release's) or `X.weight_scale` (b12x's) is the scale of `X.weight` when the
checkpoint stores `X.weight` (otherwise it is a weight, like the state-dict name
`attn_hc.scale`); `X.weight_scale_inv` and, for merged experts,
`experts.gate_up_proj_scale_inv` are scales by name.

How `transformers` 5.24 loads this layout (read in its source, shown by
tests/exporter/hf/test_release_checkpoint.py on the CPU):

- `quantization_config.quant_method: fp8` selects its fine-grained FP8 quantizer, which
  needs `accelerate` installed (ImportError otherwise). Without a CUDA or XPU device a
  pre-quantized checkpoint is decoded on load (`dequantize = True`, logged as "dequantizing
  the model to bf16"); with `dtype=torch.float32` every decoded weight is float32, and
  `quantization_config` is gone from the loaded model's config.
- Names it expects are exactly the release's: `<module>.scale` is renamed to
  `<module>.weight_scale_inv` before the model's own renames; per-expert `ffn.experts.{j}.w1/w3`
  and `w2` are decoded first and then merged into `gate_up_proj` / `down_proj`. The MTP
  stage (`mtp.*`) is ignored. State-dict names with `<module>.weight_scale_inv` scales
  (routed experts still one tensor each) load as well; `attn_hc.scale` stays a weight.
- The decode is exact in float32: FP8 `weight.float() * scale` per block, FP4 a 16-entry
  table times 2^(byte-127); UE8M0 may be `float8_e8m0fnu` or uint8. The block is inferred
  from the grid (`rows // grid_rows`), not from `weight_block_size`: a dimension that is not
  a multiple of the block is refused when it does not divide by the grid, and decoded with a
  wrong block when it does (192 rows in 128-row blocks: grid 2, taken as two 96-row blocks).
  Tests keep every quantized dimension a multiple of the block.
- Modules then run plain `F.linear` on the decoded weights: no activation quantization.
- `expert_dtype` at the top level is moved into `quantization_config` by DeepseekV4Config.
  `transformers` 5.24 has no V4.1 model (`deepseek_v41`); a V4 model with V4.1's 32x32
  blocks loads and decodes like the 128x128 one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from b12x_toolchain.exporter.hf.quantization import Quantization, release_role_formats
from b12x_toolchain.exporter.model.weight_roles import role_of
from b12x_toolchain.runtime.formats.weight_formats import FP4_BLOCK, FP4_E2M1, FP32, WeightFormat
from b12x_toolchain.runtime.package.checkpoint import CheckpointError

__all__ = ["INT64", "NativeTensor", "ReleaseCheckpoint", "describe", "is_quantized", "release_formats",
           "stack_experts"]

# The hash-routing table is an integer tensor, not a stored format: the reader expects it by its
# logical dtype, and `expected` maps it to this string where every other weight has a WeightFormat.
INT64 = "int64"
Expected = WeightFormat | str  # str: INT64 only

# Weights with no role (weight_roles.py): the release keeps them in fp32.
FP32_KEPT = re.compile(r"(\.sinks|_hc\.(fn|base|scale)|hc_head\.hc_(fn|base|scale)|\.position_bias"
                       r"|\.e_score_correction_bias)$")


def describe(expect: Expected) -> str:
    """A format in an error message's words."""
    if isinstance(expect, str):
        return expect
    if expect.kind == "fp4_e2m1":
        return f"fp4_e2m1 (packed int8, ue8m0 scale per {FP4_BLOCK[1]} inputs)"
    if expect.kind == "fp8_e4m3":
        return f"fp8_e4m3 ({expect.block[0]}x{expect.block[1]} blocks, {expect.scale_encoding} scales)"
    return expect.kind


def is_quantized(expect: Expected) -> bool:
    return not isinstance(expect, str) and expect.quantized


def release_formats(names, *, block: tuple[int, int] = (128, 128), scale_encoding: str = "ue8m0",
                    experts: str = "fp4") -> dict[str, Expected]:
    """The format DeepSeek's V4 release stores each named weight in (b12x names).

    block / scale_encoding: the FP8 linears' (128x128 ue8m0 in V4 Instruct, fp32 in
    V4-Base; 32x32 in V4.1); experts: "fp4" (Instruct) or "fp8" (Base, like the linears).
    A name the release's scheme does not place is refused rather than guessed.
    """
    by_role = release_role_formats(block, scale_encoding, experts)
    out = {}
    for name in names:
        role = role_of(name)
        if role in by_role:
            out[name] = by_role[role]
        elif role is None and FP32_KEPT.search(name):
            out[name] = FP32
        elif name.endswith(".gate.tid2eid"):
            out[name] = INT64
        else:
            raise ValueError(f"{name}: not a weight whose format the V4 release fixes")
    return out


@dataclass(frozen=True)
class NativeTensor:
    """A weight as the checkpoint stores it.

    data: float8_e4m3fn (fp8), int8 two codes a byte with the even column low (fp4),
    bfloat16, float32 or int64. scale: float8_e8m0fnu or float32, one per block (None when
    unquantized). format: what the recipe expected, a WeightFormat or INT64. stored: the
    checkpoint's name for the data tensor.
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    format: Expected
    stored: str

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's logical shape (fp4: twice the packed last dimension)."""
        shape = tuple(self.data.shape)
        return (*shape[:-1], 2 * shape[-1]) if self.format == FP4_E2M1 else shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)


@dataclass
class ReleaseCheckpoint:
    """A checkpoint's weights in their stored formats, by b12x name.

    weights: every weight stored whole. experts: routed experts stored one tensor per expert,
    by merged name -> {(expert, part): piece}, part 0 the gate rows (w1) and 1 the up rows (w3)
    of gate_up_proj (down_proj has only part 0); `stacked` merges them.
    """

    quantization: Quantization | None
    weights: dict[str, NativeTensor] = field(default_factory=dict)
    experts: dict[str, dict[tuple[int, int], NativeTensor]] = field(default_factory=dict)

    def stacked(self, name: str) -> NativeTensor:
        """One routed-expert weight whole: stored so, or stacked from its pieces."""
        if name in self.weights:
            return self.weights[name]
        return stack_experts(name, self.experts[name])


def stack_experts(name: str, pieces: dict[tuple[int, int], NativeTensor]) -> NativeTensor:
    """Per-expert pieces -> b12x's merged tensor, still in their format: [E, rows, cols] for
    down_proj, [E, gate rows | up rows, cols] for gate_up_proj; the scales likewise.

    Concatenating gate and up rows keeps each scale with its block only when the block's
    rows divide the piece's rows; otherwise the merged grid would differ, so it is refused.
    """
    experts = 1 + max(expert for expert, _ in pieces)
    parts = sorted({part for _, part in pieces})
    first = pieces[(0, 0)]
    fmt, rows = first.format, first.shape[0]
    if is_quantized(fmt) and len(parts) > 1 and rows % fmt.block[0]:
        raise CheckpointError(f"{name}: its gate and up rows ({rows} each) do not fill whole {describe(fmt)} blocks, so "
                              f"they cannot be concatenated without re-encoding")

    def merged(attr: str) -> torch.Tensor | None:
        if getattr(first, attr) is None:
            return None
        return torch.cat([torch.stack([getattr(pieces[(e, p)], attr) for e in range(experts)]) for p in parts], dim=1)

    return NativeTensor(merged("data"), merged("scale"), fmt, f"{first.stored} (and its {len(pieces) - 1} peers)")
