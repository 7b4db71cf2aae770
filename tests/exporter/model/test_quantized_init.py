"""Random weights in the recipe's formats are the float32 draw of the same seed, quantized:
one seed is one model in every format."""

from __future__ import annotations

import torch

from b12x_toolchain.exporter.model.weights import SCALE_SUFFIX, init_weights, weight_formats, weight_specs
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.runtime.formats.weight_formats import decode_fp4, decode_fp8_block

SCHEME = {"activation": "deepseek", "routed_experts": "fp4_e2m1", "embeddings": "bf16", "norms": "bf16",
          # a dict of its own per role: the recipe's YAML refuses a shared (aliased) one
          **{role: {"format": "fp8_e4m3", "block": [32, 32], "scale": "ue8m0"}
             for role in ("attention", "indexer_query", "shared_experts", "draft_input")}}


def test_quantized_random_weights_are_the_float32_draw_quantized():
    base = load_recipe("dsv41-tiny")
    d = Dims.from_recipe(recipe_variant(base, {"weights": SCHEME}, name="dsv41-tiny-quantized"))
    plain = init_weights(Dims.from_recipe(base), seed=5)
    got = init_weights(d, seed=5)
    specs, formats = weight_specs(d), weight_formats(d)
    assert {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in got.items()} == \
        {n: (dtype, shape) for n, (shape, dtype) in specs.items()}
    kinds = set()
    for name, draw in plain.items():
        fmt = formats.get(name)
        kind = "fp32" if fmt is None else fmt.kind
        kinds.add(kind)
        if kind == "fp32":
            assert torch.equal(got[name], draw), name
        elif kind == "bf16":
            assert torch.equal(got[name], draw.bfloat16()), name
        else:
            data, scale = got[name], got[name + SCALE_SUFFIX]
            if kind == "fp4_e2m1":
                decoded = decode_fp4(data, scale)
                step = 0.5  # E2M1 holds 2 significant bits: within a quarter of a value's binade, x2 for the scale
            else:
                decoded = torch.stack([decode_fp8_block(a, b, fmt.block) for a, b in
                                       zip(data.view(-1, *data.shape[-2:]), scale.view(-1, *scale.shape[-2:]))])
                decoded = decoded.view(draw.shape)
                step = 2.0 ** -3
            # Each value is its draw rounded within its block's scale: near, and not a float32 copy.
            assert not torch.equal(decoded, draw), name
            assert (decoded - draw).abs().max() <= step * draw.abs().max(), name
    assert kinds == {"fp32", "bf16", "fp8_e4m3", "fp4_e2m1"}
