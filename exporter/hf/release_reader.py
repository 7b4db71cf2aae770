"""Read a DeepSeek V4 / V4.1 checkpoint in the formats it ships, one tensor at a time, checked
against the formats the recipe expects; nothing is decoded (release_layout.py describes the
layout, and what `read_release_checkpoint` returns).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from b12x_toolchain.exporter.hf.config import CONFIG, HfConfigError, read_config
from b12x_toolchain.exporter.hf.names import Target, computed_table, scale_owner, target_of
from b12x_toolchain.exporter.hf.quantization import Quantization, read_quantization
from b12x_toolchain.exporter.hf.release_layout import (
    INT64,
    Expected,
    NativeTensor,
    ReleaseCheckpoint,
    describe,
    is_quantized,
)
from b12x_toolchain.exporter.model.weight_roles import ROLE_BLOCKS, role_of, weight_role
from b12x_toolchain.exporter.model.weights import EMBED, LM_HEAD
from b12x_toolchain.runtime.package.checkpoint import CheckpointError, weight_map

__all__ = ["read_release_checkpoint"]


# --- config.json ------------------------------------------------------------------

def _check_declared(quantization: Quantization | None, expected: dict[str, Expected]) -> None:
    """The config's declaration must be the recipe's: same block, scale encoding and expert kind."""
    quantized = {name: fmt for name, fmt in expected.items() if is_quantized(fmt)}
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
        role = role_of(name)
        if fmt.kind == "fp8_e4m3" and role != "routed_experts":
            # A role with its own block (Engram's 1x32 tables) keeps it whatever weight_block_size says.
            fixed = role in ROLE_BLOCKS
            if quantization.block is not None and fmt.block != quantization.block and not fixed:
                raise CheckpointError(f"{CONFIG}: quantization_config.weight_block_size {list(quantization.block)} "
                                      f"differs from the recipe's {describe(fmt)} for {name}")
            if fmt.scale_encoding != quantization.scale_encoding:
                raise CheckpointError(f"{CONFIG}: quantization_config declares {quantization.scale_encoding} scales, "
                                      f"but the recipe expects {describe(fmt)} for {name}")
        if role == "routed_experts":
            kind = "fp4_e2m1" if quantization.expert_dtype == "fp4" else "fp8_e4m3"
            if fmt.kind != kind:
                raise CheckpointError(f"{CONFIG}: expert_dtype {quantization.expert_dtype!r} declares {kind} routed "
                                      f"experts, but the recipe expects {describe(fmt)} for {name}")


# --- tensor names -----------------------------------------------------------------

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
        owner = scale_owner(name, names)
        if owner is not None:
            scales.setdefault(owner, []).append(name)
            continue
        target = target_of(name)
        if target.name in expected:
            plan[name] = _Stored(name, target)
        elif not computed_table(name):
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

# A safetensors dtype -> the element type (or INT64) it holds; the scale encoding -> its dtypes.
STORED_ELEMENT_TYPES = {"F8_E4M3": "fp8_e4m3", "I8": "fp4_e2m1", "U8": "fp4_e2m1", "BF16": "bf16", "F32": "fp32",
                        "I64": "int64", "I32": "int64"}
STORED_SCALE_DTYPES = {"ue8m0": ("F8_E8M0", "U8", "F32"), "fp32": ("F32",)}


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



def _read_one(handles, mapping, stored: _Stored, fmt: Expected, shape) -> NativeTensor:
    data_slice = handles(mapping[stored.data]).get_slice(stored.data)
    scale_slice = None if stored.scale is None else handles(mapping[stored.scale]).get_slice(stored.scale)
    dtype, got_shape = data_slice.get_dtype(), tuple(data_slice.get_shape())
    holds = "" if stored.target.name == stored.data else f" (it holds {stored.target.describe()})"

    def refuse(why: str) -> CheckpointError:
        return CheckpointError(f"{stored.data}: the recipe expects {describe(fmt)}{holds}; {why}")

    kind, quantized = (fmt, False) if isinstance(fmt, str) else (fmt.kind, fmt.quantized)
    if STORED_ELEMENT_TYPES.get(dtype) != kind or quantized != (scale_slice is not None):
        if quantized and scale_slice is None and STORED_ELEMENT_TYPES.get(dtype) == kind:
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
        if scale_dtype not in STORED_SCALE_DTYPES[fmt.scale_encoding]:
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
                parts = weight_role(weight).parts
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
            parts = range(weight_role(weight).parts)
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
