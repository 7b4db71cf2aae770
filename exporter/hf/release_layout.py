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

`read_release_checkpoint` returns each weight of the recipe as a `NativeTensor` — the bytes
the checkpoint holds plus its scale — under b12x's names, after checking it against the
format the recipe expects (a `WeightFormat`, or the logical dtype int64 of the hash-routing
table, which is no stored format); anything else is a `CheckpointError` naming the
stored tensor, the expected format and what the checkpoint has. Routed experts come per
expert (`ReleaseCheckpoint.experts`); `stack_experts` merges them into b12x's
`experts.gate_up_proj` [E, 2I, D] and `experts.down_proj` [E, D, I] still packed: gate rows
(w1) then up rows (w3) per expert, scales stacked the same way, which keeps every scale
with its block as long as the block's rows divide I (always for FP4's 1x32). UE8M0 scales
may be stored as F8_E8M0, uint8 (the same byte) or float32 powers of two; all become
`float8_e8m0fnu`. Only JSON and safetensors are read, one tensor at a time, and no weight is
decoded or widened to float32; only an int32 hash-routing table becomes int64, b12x's width.

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
from pathlib import Path

import torch
from safetensors import safe_open

from b12x_toolchain.exporter.hf.config import CONFIG, HfConfigError, read_config
from b12x_toolchain.exporter.hf.names import Target, target_of
from b12x_toolchain.exporter.hf.quantization import (
    BF16,
    FP4_E2M1,
    Quantization,
    read_quantization,
    release_role_formats,
)
from b12x_toolchain.exporter.model.weight_roles import ROLE_BLOCKS, role_of
from b12x_toolchain.runtime.package.checkpoint import CheckpointError, weight_map
from b12x_toolchain.runtime.package.weight_format import FP4_BLOCK, FP32, WeightFormat

__all__ = ["BF16", "FP32", "FP4_E2M1", "INT64", "NativeTensor", "Quantization", "ReleaseCheckpoint", "describe",
           "read_release_checkpoint", "release_formats", "stack_experts"]

LM_HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"
# The hash-routing table is an integer tensor, not a stored format: the reader expects it by its
# logical dtype, and `expected` maps it to this string where every other weight has a WeightFormat.
INT64 = "int64"
Expected = WeightFormat | str  # str: INT64 only

ROUTED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
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


def _quantized(expect: Expected) -> bool:
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
    if _quantized(fmt) and len(parts) > 1 and rows % fmt.block[0]:
        raise CheckpointError(f"{name}: its gate and up rows ({rows} each) do not fill whole {describe(fmt)} blocks, so "
                              f"they cannot be concatenated without re-encoding")

    def merged(attr: str) -> torch.Tensor | None:
        if getattr(first, attr) is None:
            return None
        return torch.cat([torch.stack([getattr(pieces[(e, p)], attr) for e in range(experts)]) for p in parts], dim=1)

    return NativeTensor(merged("data"), merged("scale"), fmt, f"{first.stored} (and its {len(pieces) - 1} peers)")


# --- config.json ------------------------------------------------------------------

def _check_declared(quantization: Quantization | None, expected: dict[str, Expected]) -> None:
    """The config's declaration must be the recipe's: same block, scale encoding and expert kind."""
    quantized = {name: fmt for name, fmt in expected.items() if _quantized(fmt)}
    if quantization is None:
        if quantized:
            name, fmt = next(iter(sorted(quantized.items())))
            raise CheckpointError(f"{CONFIG}: no quantization_config, but the recipe expects quantized weights "
                                  f"({name}: {describe(fmt)})")
        return
    if not quantized:
        raise CheckpointError(f"{CONFIG}: quantization_config declares a quantized ({quantization.method}) "
                              f"checkpoint, but the recipe expects every weight unquantized")
    for name, fmt in sorted(quantized.items()):
        if fmt.kind == "fp8_e4m3" and ROUTED_EXPERTS.search(name) is None:
            # A role with its own block (Engram's 1x32 tables) keeps it whatever weight_block_size says.
            fixed = role_of(name) in ROLE_BLOCKS
            if quantization.block is not None and fmt.block != quantization.block and not fixed:
                raise CheckpointError(f"{CONFIG}: quantization_config.weight_block_size {list(quantization.block)} "
                                      f"differs from the recipe's {describe(fmt)} for {name}")
            if fmt.scale_encoding != quantization.scale_encoding:
                raise CheckpointError(f"{CONFIG}: quantization_config declares {quantization.scale_encoding} scales, "
                                      f"but the recipe expects {describe(fmt)} for {name}")
        if ROUTED_EXPERTS.search(name):
            kind = "fp4_e2m1" if quantization.expert_dtype == "fp4" else "fp8_e4m3"
            if fmt.kind != kind:
                raise CheckpointError(f"{CONFIG}: expert_dtype {quantization.expert_dtype!r} declares {kind} routed "
                                      f"experts, but the recipe expects {describe(fmt)} for {name}")


# --- tensor names -----------------------------------------------------------------

def _scale_owner(name: str, stored: set[str]) -> str | None:
    """The data tensor `name` is the scale of, or None when it is not a scale."""
    if name.endswith(".weight_scale_inv"):
        return name.removesuffix("_scale_inv")
    if name.endswith("_scale_inv"):  # merged experts: experts.gate_up_proj_scale_inv
        return name.removesuffix("_scale_inv")
    if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in stored:
        return name.removesuffix(".scale") + ".weight"
    if name.endswith(".weight_scale") and name.removesuffix("_scale") in stored:  # b12x's own layout
        return name.removesuffix("_scale")
    return None


@dataclass
class _Stored:
    """A weight's stored data tensor and, when it has one, its scale."""

    data: str
    target: Target
    scale: str | None = None


def _plan(mapping: dict[str, Path], expected: dict[str, Expected]) -> dict[str, _Stored]:
    """Stored data name -> its target and scale; refuses unknown tensors and a second scale."""
    names = set(mapping)
    plan, scales, extra = {}, {}, []
    for name in sorted(names):
        owner = _scale_owner(name, names)
        if owner is not None:
            scales.setdefault(owner, []).append(name)
            continue
        target = target_of(name)
        if target.name in expected:
            plan[name] = _Stored(name, target)
        elif not name.endswith("inv_freq"):  # RoPE tables some savers write; computed from config.json
            extra.append(name)
    for owner, found in sorted(scales.items()):
        if owner not in plan:
            extra.extend(found)
        elif len(found) > 1:
            raise CheckpointError(f"{found[0]}: {owner} has more than one scale ({', '.join(found)})")
        else:
            plan[owner].scale = found[0]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{sorted(extra)[0]}: in the checkpoint but not a weight of the recipe's model{more}")
    return plan


# --- checks and reads, one tensor at a time --------------------------------------

DATA_DTYPES = {"F8_E4M3": "fp8_e4m3", "I8": "fp4_e2m1", "U8": "fp4_e2m1", "BF16": "bf16", "F32": "fp32",
               "I64": "int64", "I32": "int64"}


def _has(stored: _Stored, dtype: str, shape, scale_slice) -> str:
    """What the checkpoint holds, in words, for an error message."""
    scale = "without a scale" if scale_slice is None else (
        f"with a {scale_slice.get_dtype()} {list(scale_slice.get_shape())} scale {stored.scale}")
    return f"{dtype} {list(shape)} {scale}"


def _canonical_ue8m0(name: str, scale: torch.Tensor) -> torch.Tensor:
    """A UE8M0 scale as float8_e8m0fnu, from F8_E8M0, uint8 (the biased exponent) or float32."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale
    if scale.dtype == torch.uint8:
        return scale.view(torch.float8_e8m0fnu)
    bits = scale.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    # A positive normal power of two: sign and mantissa clear, exponent neither 0 nor 255.
    exact = ((bits & 0x807FFFFF) == 0) & (exponent > 0) & (exponent < 255)
    if not bool(exact.all()):
        bad = scale.reshape(-1)[~exact.reshape(-1)][0].item()
        raise CheckpointError(f"{name}: float32 scale {bad!r} is not a power of two, so it is not a UE8M0 scale")
    return exponent.to(torch.uint8).view(torch.float8_e8m0fnu)


SCALE_DTYPES = {"ue8m0": ("F8_E8M0", "U8", "F32"), "fp32": ("F32",)}


def _read_one(handles, mapping, stored: _Stored, fmt: Expected, shape) -> NativeTensor:
    data_slice = handles(mapping[stored.data]).get_slice(stored.data)
    scale_slice = None if stored.scale is None else handles(mapping[stored.scale]).get_slice(stored.scale)
    dtype, got_shape = data_slice.get_dtype(), tuple(data_slice.get_shape())
    holds = "" if stored.target.name == stored.data else f" (it holds {stored.target.describe()})"

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{stored.data}: the recipe expects {describe(fmt)}{holds}; {why}")

    kind, quantized = (fmt, False) if isinstance(fmt, str) else (fmt.kind, fmt.quantized)
    if DATA_DTYPES.get(dtype) != kind or quantized != (scale_slice is not None):
        if quantized and scale_slice is None and DATA_DTYPES.get(dtype) == kind:
            raise refuse(f"the checkpoint has no scale for it ({stored.data.removesuffix('.weight')}.scale or "
                         f"{stored.data.removesuffix('.weight')}.weight_scale_inv)")
        raise refuse(f"the checkpoint has {_has(stored, dtype, got_shape, scale_slice)}")
    stored_shape = None if shape is None else tuple(shape) if isinstance(fmt, str) else fmt.data_shape(tuple(shape))
    if shape is not None and got_shape != stored_shape:
        raise refuse(f"the checkpoint has shape {list(got_shape)}, not {list(stored_shape)}")
    logical = got_shape if shape is None else tuple(shape)
    if kind == "fp4_e2m1":
        logical = (*got_shape[:-1], 2 * got_shape[-1])
    scale = None
    if scale_slice is not None:
        scale_dtype, scale_shape = scale_slice.get_dtype(), tuple(scale_slice.get_shape())
        grid = fmt.scale_shape(logical)
        if scale_shape != grid:
            raise refuse(f"its scale {stored.scale} has grid {list(scale_shape)}, which does not match "
                         f"{fmt.block[0]}x{fmt.block[1]} blocks of {list(logical)} ({list(grid)})")
        if scale_dtype not in SCALE_DTYPES[fmt.scale_encoding]:
            raise refuse(f"its scale {stored.scale} is {scale_dtype}")
        raw = handles(mapping[stored.scale]).get_tensor(stored.scale)
        scale = _canonical_ue8m0(stored.scale, raw) if fmt.scale_encoding == "ue8m0" else raw
    data = handles(mapping[stored.data]).get_tensor(stored.data)
    if dtype == "U8":
        data = data.view(torch.int8)  # the same packed bytes; int8 is the release's and b12x's dtype
    elif dtype == "I32":
        data = data.to(torch.int64)  # the hash-routing table; b12x holds it as int64
    return NativeTensor(data, scale, fmt, stored.data)


class _Shards:
    """Open shards, each once; closed on exit."""

    def __init__(self):
        self.open = {}

    def __call__(self, path: Path):
        if path not in self.open:
            if not path.is_file():
                raise CheckpointError(f"{path.name}: a shard the index names is missing from the checkpoint")
            try:
                self.open[path] = safe_open(str(path), framework="pt").__enter__()
            except Exception as exc:  # safetensors raises its own error type for malformed headers
                raise CheckpointError(f"{path.name}: not a valid safetensors file ({exc})") from None
        return self.open[path]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in self.open.values():
            handle.__exit__(None, None, None)


def _piece_shape(shape, parts: int):
    """One routed expert's piece of a merged [E, rows, cols] weight."""
    if shape is None:
        return None
    return (shape[1] // parts, *shape[2:])


def read_release_checkpoint(directory, expected: dict[str, Expected],
                            shapes: dict[str, tuple[int, ...]] | None = None) -> ReleaseCheckpoint:
    """Every weight `expected` names, in its stored format, checked against it; nothing decoded.

    expected: b12x weight name -> the WeightFormat the recipe has for it, or INT64 for an
    integer table (stored as its logical dtype, not in a format); shapes (optional): b12x
    weight name -> logical shape, checked too and fixing the number of routed experts.
    Tied embeddings (config.json's tie_word_embeddings) give lm_head as a copy of the
    embedding. config.json's own model fields are not checked here; the import that calls
    this checks them.
    """
    root = Path(directory)
    mapping = weight_map(root)  # refuses what is not a checkpoint directory
    try:
        config = read_config(root / CONFIG)
    except HfConfigError as exc:  # names the file already
        raise CheckpointError(str(exc)) from None
    for name, expect in expected.items():
        if isinstance(expect, str) and expect != INT64:
            raise ValueError(f"{name}: {expect!r} is neither a WeightFormat nor {INT64!r}")
    try:
        quantization = read_quantization(config)
    except HfConfigError as exc:  # names the key
        raise CheckpointError(f"{CONFIG}: {exc}") from None
    _check_declared(quantization, expected)
    plan = _plan(mapping, expected)
    by_weight: dict[str, dict[tuple, _Stored]] = {}
    for stored in plan.values():
        target = stored.target
        held = by_weight.setdefault(target.name, {})
        key = (target.expert, target.part)
        if key in held:
            raise CheckpointError(f"{stored.data}: holds the same weight as {held[key].data} ({target.describe()})")
        if held and (key == (None, 0)) != ((None, 0) in held):
            raise CheckpointError(f"{stored.data}: {target.name} is stored both whole and per routed expert "
                                  f"({next(iter(held.values())).data})")
        held[key] = stored
    tied = config.get("tie_word_embeddings") is True
    out = ReleaseCheckpoint(quantization)
    # Shard order, so each file is read front to back once.
    order = sorted(plan.values(), key=lambda s: (str(mapping[s.data]), s.data))
    with _Shards() as handles:
        pieces_read = {}
        for stored in order:
            weight = stored.target.name
            shape = None if shapes is None else shapes[weight]
            if stored.target.expert is None:
                out.weights[weight] = _read_one(handles, mapping, stored, expected[weight], shape)
            else:
                parts = 2 if weight.endswith("gate_up_proj") else 1
                if shape is not None and stored.target.expert >= shape[0]:
                    raise CheckpointError(f"{stored.data}: routed expert {stored.target.expert}, but the recipe has "
                                          f"{shape[0]} experts")
                pieces_read[stored.data] = _read_one(handles, mapping, stored, expected[weight],
                                                     _piece_shape(shape, parts))
    for weight, held in by_weight.items():
        if (None, 0) not in held:
            out.experts[weight] = {key: pieces_read[s.data] for key, s in sorted(held.items())}
    _complete(out, expected, shapes, tied)
    return out


def _complete(out: ReleaseCheckpoint, expected: dict[str, Expected], shapes, tied: bool) -> None:
    """Refuse a weight not stored in full; give a tied lm_head the embedding's tensor."""
    for weight, fmt in sorted(expected.items()):
        if weight in out.weights:
            continue
        if weight in out.experts:
            held = out.experts[weight]
            parts = (0, 1) if weight.endswith("gate_up_proj") else (0,)
            experts = shapes[weight][0] if shapes is not None else 1 + max(e for e, _ in held)
            for key in [(e, p) for e in range(experts) for p in parts]:
                if key not in held:
                    raise CheckpointError(f"{Target(weight, *key).describe()}: not in the checkpoint; the recipe "
                                          f"expects {describe(fmt)}")
            continue
        if weight == LM_HEAD and tied and EMBED in out.weights:
            embed = out.weights[EMBED]
            if fmt != embed.format:
                raise CheckpointError(f"{LM_HEAD}: tied to {EMBED}, which is {describe(embed.format)}; the recipe "
                                      f"expects {describe(fmt)}")
            out.weights[LM_HEAD] = NativeTensor(embed.data.clone(), None, fmt, embed.stored)
            continue
        raise CheckpointError(f"{weight}: not in the checkpoint; the recipe expects {describe(fmt)}")
