"""The independent reference for DeepSeek V4: `transformers`' DeepseekV4ForCausalLM on a
tiny config mirroring a b12x recipe, built locally (nothing is downloaded)."""

from __future__ import annotations

import torch

from b12x.exporter.dims import Dims
from b12x.exporter.hf_config_writer import hf_config_dict


def hf_config(recipe):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{k: v for k, v in hf_config_dict(recipe).items() if k not in ("model_type", "architectures")})


def reference_model(recipe, weights: dict[str, torch.Tensor]):
    """The reference with `weights` (b12x names are the checkpoint's; MTP tensors are ignored)."""
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(hf_config(recipe)).eval()
    model.load_state_dict({k: v for k, v in weights.items() if not k.startswith("mtp.")}, strict=True)
    return model


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """One full forward, no cache: [len(tokens), vocab]."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def dims(recipe) -> Dims:
    return Dims.from_recipe(recipe)
