"""The target's own greedy continuations, for the drafter to learn what it will be asked.

At temperature 0 a drafter is scored on sequences the target writes itself, which differ
from the corpus (a small model repeats itself, for one). The trained target is quantized to
the shipping formats, exported with larger rows buckets, and decodes prompts cut from the
training windows through the serving engine, as `b12x run --greedy` would: the same
numerics the drafter meets at replay.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.variants import recipe_from_dict
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request

ROWS = 32  # rows a decode step serves: fewer steps than the shipping recipe's buckets allow


def generation_recipe(data: dict):
    """The shipping recipe with prefill and decode buckets of up to ROWS rows."""
    data = copy.deepcopy(data)
    data["name"] = data["name"] + "-generation"
    for name in ("prefill", "decode"):
        data["passes"][name]["rows_buckets"] = sorted({*data["passes"][name]["rows_buckets"], ROWS})
    return recipe_from_dict(data)


def greedy_continuations(data: dict, stored_weights: dict, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[N, prompt + new_tokens]: each prompt [N, P] and the target's greedy tokens after it."""
    with tempfile.TemporaryDirectory(prefix="b12x-train-") as tmp:
        package = load(export_package(generation_recipe(data), Path(tmp), weights=stored_weights).path)
    engine = Engine(package.session(slots=ROWS), speculative=False)
    states = engine.generate([Request(row.tolist(), new_tokens) for row in prompts])
    return torch.tensor([s.prompt + s.tokens for s in states], dtype=torch.int64)
