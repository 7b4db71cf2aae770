"""Checkpoint directories on the exporter's side: write one, read an index's checksums.

The layout is Hugging Face's: safetensors shards plus `model.safetensors.index.json`
whose `weight_map` maps each tensor name to its shard. b12x adds a top-level `sha256`
map (tensor name → sha256 of its bytes); other readers ignore it, and a structural
export copies it into the package so `runtime.load` can check every bound tensor.
Tensor names are b12x's own (mapping upstream checkpoint names is a separate step).
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch

from b12x_toolchain.runtime.package.checkpoint import INDEX, CheckpointError, tensor_sha256


def write_checkpoint(weights: dict[str, torch.Tensor], root, shard_bytes: int = 1 << 30) -> Path:
    """Write `weights` as shards of at most about `shard_bytes` each, plus the index."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], {}, 0
    for name in sorted(weights):
        tensor = weights[name].detach().contiguous().cpu()
        if current and size + tensor.nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += tensor.nbytes
    if current:
        shards.append(current)
    weight_map, checksums = {}, {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        safetensors.torch.save_file(shard, str(root / file), metadata={"format": "pt"})
        for name, tensor in shard.items():
            weight_map[name], checksums[name] = file, tensor_sha256(tensor)
    index = {"metadata": {"total_size": sum(t.nbytes for t in weights.values())},
             "weight_map": weight_map, "sha256": checksums}
    (root / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return root


def index_checksums(path, names) -> dict[str, str]:
    """The index's checksums for `names`; every name must be in its weight_map.

    `path` is a checkpoint directory or its index file: CI keeps just the index (a few
    MB) in place of the weights. An index without a `sha256` map gives no checksums.
    """
    path = Path(path)
    index = path / INDEX if path.is_dir() else path
    try:
        data = json.loads(index.read_bytes())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index.name}: cannot read the checkpoint index ({exc})") from None
    weight_map, checksums = data.get("weight_map"), data.get("sha256", {})
    if not isinstance(weight_map, dict) or not isinstance(checksums, dict):
        raise CheckpointError(f"{index.name}: 'weight_map' and 'sha256' must be objects")
    missing = sorted(set(names) - set(weight_map))
    if missing:
        raise CheckpointError(f"{missing[0]}: not in the checkpoint index {index.name}")
    return {name: checksums[name] for name in sorted(names) if name in checksums}
