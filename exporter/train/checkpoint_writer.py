"""The trained weights as a release-layout checkpoint: native formats, scales beside them.

Each weight is stored in the format the shipping recipe's `weights` section gives its role
(FP8 E4M3 projections in 32x32 blocks and FP4 E2M1 experts, both with UE8M0 scales; FP8
Engram tables with a scale per 32 values of a row; bf16 embeddings, heads and norms), a
block-scaled weight's scale under the release's name for it (`.scale` beside a `.weight`,
`_scale_inv` beside merged experts), Engram tensors under DeepSeek's names
(`layers.{i}.engram.*`), the rest under their Hugging Face state-dict names, which
DeepSeek's loaders and b12x's reader (exporter/hf/names.py) map the same way. config.json
states the model as a V4.1 release does, with its quantization_config.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from b12x_toolchain.exporter.hf.config_writer import v41_config_dict
from b12x_toolchain.exporter.hf.names import release_scale_name
from b12x_toolchain.exporter.model.weights import SCALE_SUFFIX, logical_specs, quantize_stored, weight_formats
from b12x_toolchain.exporter.pipeline.checkpoint_index import write_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SUMS_FILE = "SHA256SUMS"
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0", "expert_dtype": "fp4",
                "weight_block_size": [32, 32]}


def stored_name(name: str) -> str:
    """The checkpoint's name for b12x weight `name`."""
    return name.removeprefix("model.") if name.startswith("model.layers.") and ".engram." in name else name


def scale_name(name: str) -> str:
    """The checkpoint's name for the scale of b12x weight `name`."""
    return release_scale_name(stored_name(name))


def stored_weights(d, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float weights (every name of `logical_specs(d)`) as a package stores them in `d`'s formats:
    the data under the weight's name, a block-scaled one's scale beside it."""
    formats = weight_formats(d)
    out = {}
    for name in logical_specs(d):
        tensor = weights[name].detach()
        if name not in formats or not tensor.is_floating_point():
            out[name] = tensor.contiguous()
            continue
        out[name], scale = quantize_stored(tensor.float(), formats[name])
        if scale is not None:
            out[name + SCALE_SUFFIX] = scale
    return out


def release_tensors(d, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`stored_weights` under the checkpoint's names."""
    stored = stored_weights(d, weights)
    out = {}
    for name in logical_specs(d):
        out[stored_name(name)] = stored[name]
        if name + SCALE_SUFFIX in stored:
            out[scale_name(name)] = stored[name + SCALE_SUFFIX]
    return out


def write_release_checkpoint(directory: Path, recipe, d, weights: dict[str, torch.Tensor], tokenizer_dir: Path,
                             training: dict) -> Path:
    """Write the checkpoint into `directory` (created; refused if it holds anything)."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory}: not empty; the checkpoint is written into a new or empty directory")
    write_checkpoint(release_tensors(d, weights), directory)
    config = {**v41_config_dict(recipe), "quantization_config": QUANTIZATION, "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copyfile(Path(tokenizer_dir) / name, directory / name)
    (directory / "training.json").write_text(json.dumps(training, indent=2, sort_keys=True) + "\n")
    write_sums(directory)
    return directory


def write_sums(directory: Path) -> None:
    """SHA256SUMS (`sha256sum` format) over every other file of the checkpoint, written last."""
    lines = [f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}"
             for path in sorted(Path(directory).iterdir()) if path.name != SUMS_FILE]
    (Path(directory) / SUMS_FILE).write_text("\n".join(lines) + "\n")
