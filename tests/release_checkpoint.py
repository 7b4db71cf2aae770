"""A tiny DeepSeek V4 checkpoint in the layout and formats DeepSeek's V4 Instruct release ships.

`write_release_checkpoint` takes a tiny model's float32 weights (by b12x's names, as
`hf_reference.tiny_weights` gives them) and writes what the release holds:

- FP8 E4M3 with one scale per `block` (128x128 in V4; V4.1 uses 32x32) for the attention
  projections (`attn.wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`), the indexer's `wq_b`, the
  shared experts (`w1`, `w2`, `w3`) and the MTP stage's `e_proj` / `h_proj`. The scale is
  UE8M0 (`float8_e8m0fnu`, 2^ceil(log2(amax / 448)) per block) under `<module>.scale`, as
  V4 Instruct stores it; or float32 (amax / 448, V3-style and V4-Base) under
  `<module>.scale` or `<module>.weight_scale_inv`.
- Routed experts one tensor per expert (`ffn.experts.{j}.w{1,2,3}`): FP4 E2M1 packed two
  per byte in int8 `[out, in/2]`, the even column in the low nibble, with a UE8M0 scale
  per 32 inputs `[out, in/32]`; or FP8 block-scaled like the projections (V4-Base).
- BF16 for the embedding, head, norms, router weight and the compressors' and indexer's
  `wkv` / `wgate` / `weights_proj`; FP32 for sinks, mHC mixers (`hc_*`), compressor
  position bias (`ape`) and router bias; the hash-routing table as int64, as
  `transformers` saves it.

Names are the release's: a fp32 model saved by `transformers`' `save_pretrained` in its
default (original) format gives them, and the MTP stage is named as `hf_reference`
names it. config.json carries `quantization_config` and `expert_dtype` as the release's
does. The quantizers are plain torch, independent of b12x's own.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
import transformers

from hf_reference import INDEX, _mtp_tensors

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_GROUP = 32  # inputs per UE8M0 scale of a packed FP4 row
FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

# Release names by the format the V4 Instruct release stores them in.
FP8_LINEAR = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123]"
                        r"|e_proj|h_proj)\.weight$")
ROUTED_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
FP32_KEPT = re.compile(r"(\.attn_sink|\.ape|\.gate\.bias|(^|\.)hc_(attn|ffn|head)_(fn|base|scale))$")
RELEASE_TOP = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
SHARD_BYTES = 64 << 10  # small shards, so a reader goes through the index and several files


def power_of_two_at_least(ratio: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(ratio)), the UE8M0 scale that keeps ratio * scale^-1 within range."""
    return torch.exp2(torch.ceil(torch.log2(ratio.clamp_min(2.0 ** -120))))


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int], scale_dtype: str):
    """(float8_e4m3fn weight, scale per block): ue8m0 as float8_e8m0fnu, fp32 as float32.

    A dimension that is not a multiple of the block ends in a partial block; its grid
    rounds up (576 rows in 128-row blocks: 5 scale rows), as DeepSeek's checkpoints do.
    """
    rows, cols = weight.shape
    bm, bn = block
    grid = (-(-rows // bm), -(-cols // bn))
    padded = F.pad(weight.float(), (0, grid[1] * bn - cols, 0, grid[0] * bm - rows))
    blocks = padded.reshape(grid[0], bm, grid[1], bn)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = power_of_two_at_least(amax / FP8_MAX) if scale_dtype == "e8m0" else amax.clamp_min(1e-12) / FP8_MAX
    scaled = blocks / scale[:, None, :, None]
    data = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(padded.shape)[:rows, :cols].contiguous()
    return data, scale.to(torch.float8_e8m0fnu) if scale_dtype == "e8m0" else scale


def quantize_fp4_rows(weight: torch.Tensor):
    """(int8 [out, in/2] two E2M1 codes a byte, even column low; float8_e8m0fnu [out, in/32])."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    scale = power_of_two_at_least(groups.abs().amax(dim=-1) / 6.0)
    scaled = groups / scale[..., None]
    magnitude = (scaled.abs()[..., None] - FP4_MAGNITUDES).abs().argmin(dim=-1)  # nearest, the smaller on a tie
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).long() << 3).reshape(rows, cols)
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def _release_named(config: transformers.DeepseekV4Config, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 weights under the release's names: the target model's as transformers saves them
    in the original format, and the MTP stage's."""
    model = transformers.DeepseekV4ForCausalLM(config)
    model.load_state_dict({k: t for k, t in weights.items() if not k.startswith("mtp.")}, strict=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_original_format=True)
        named = {}
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            named.update(safetensors.torch.load_file(str(shard)))
    # transformers writes the base model's names with `model.` in front, and its own names for
    # the tensors outside the blocks; the release has neither.
    named = {RELEASE_TOP.get(name, name.removeprefix("model.")): t for name, t in named.items()}
    if any(name.startswith("mtp.") for name in weights):
        named.update(_mtp_tensors(weights, original_format=True))
    return named


def release_tensors(named: dict[str, torch.Tensor], *, block=(128, 128), scale_dtype: str = "e8m0",
                    scale_key: str = "scale", experts: str = "fp4") -> dict[str, torch.Tensor]:
    """Release-named fp32 tensors in the release's formats, scales beside their weights."""
    out = {}
    for name, tensor in sorted(named.items()):
        module = name.removesuffix(".weight")
        scale_name = f"{module}.{scale_key}"
        if ROUTED_EXPERT.search(name) and experts == "fp4":
            out[name], out[f"{module}.scale"] = quantize_fp4_rows(tensor)
        elif FP8_LINEAR.search(name) or ROUTED_EXPERT.search(name):
            out[name], out[scale_name] = quantize_fp8_blocks(tensor, block, scale_dtype)
        elif FP32_KEPT.search(name):
            out[name] = tensor.float()
        elif tensor.is_floating_point():
            out[name] = tensor.to(torch.bfloat16)
        else:
            out[name] = tensor  # the hash-routing table
    return out


def release_config(config: transformers.DeepseekV4Config, *, block=(128, 128), scale_dtype: str = "e8m0",
                   experts: str = "fp4", expert_dtype_inside: bool = False) -> dict:
    """config.json as the release writes it: V4 keeps `expert_dtype` at the top level,
    V4.1 inside `quantization_config` (expert_dtype_inside)."""
    document = config.to_dict()
    quantization = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": list(block)}
    if scale_dtype == "e8m0":
        quantization["scale_fmt"] = "ue8m0"
    if expert_dtype_inside:
        quantization["expert_dtype"] = experts
    else:
        document["expert_dtype"] = experts
    document["quantization_config"] = quantization
    document["torch_dtype"] = "bfloat16"
    return document


def write_shards(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Tensors in several safetensors shards plus `model.safetensors.index.json`."""
    shards, current, size = [], {}, 0
    for name, tensor in sorted(tensors.items()):
        if current and size + tensor.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor.contiguous()
        size += tensor.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.torch.save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_release_checkpoint(directory, config: transformers.DeepseekV4Config, weights: dict[str, torch.Tensor], *,
                             block=(128, 128), scale_dtype: str = "e8m0", scale_key: str = "scale",
                             experts: str = "fp4", expert_dtype_inside: bool = False) -> dict[str, torch.Tensor]:
    """Write the checkpoint into `directory` (created); returns the tensors written, by release name.

    scale_dtype: "e8m0" (V4 Instruct) or "fp32" (V3-style, V4-Base) for the FP8 block
    scales; scale_key: "scale" (V4) or "weight_scale_inv" (V3); experts: "fp4" (Instruct)
    or "fp8" (Base, block-scaled like the projections).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = release_tensors(_release_named(config, weights), block=block, scale_dtype=scale_dtype,
                              scale_key=scale_key, experts=experts)
    write_shards(directory, tensors)
    document = release_config(config, block=block, scale_dtype=scale_dtype, experts=experts,
                              expert_dtype_inside=expert_dtype_inside)
    (directory / "config.json").write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    return tensors


def rewrite_tensors(directory, edit) -> None:
    """Read every tensor of the checkpoint, apply `edit(tensors)` (it changes the dict in place),
    and write the shards and index again."""
    directory = Path(directory)
    index = json.loads((directory / INDEX).read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(safetensors.torch.load_file(str(directory / shard)))
        (directory / shard).unlink()
    edit(tensors)
    write_shards(directory, tensors)


def edit_config(directory, edit) -> None:
    """Apply `edit(document)` to config.json."""
    path = Path(directory) / "config.json"
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
