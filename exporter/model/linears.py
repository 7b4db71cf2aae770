"""How the model multiplies by a weight, by the format the recipe stores it in.

Every product goes through the op set's linears, which compute a row the same way whatever
the number of rows in the call (runtime/ops/fixed_order.py), so a token's numbers do not
depend on the pass or the batch: float32 weights through `dense_linear`. A bf16 weight is
widened to float32 where it is used and the product is taken in float32, as `transformers`
computes a checkpoint loaded with `dtype=torch.float32` (its bf16 tensors become float32
ones of the same values). Block-scaled weights go through
the op set's quantized linears, which decode exactly and never hold the whole weight in
float32: FP8 linears through `fp8_block_linear`, FP4 routed experts through
`fp4_expert_linear` on the experts each token chose. The recipe's activation rule
(`none` or `deepseek`) is handed to those ops.
"""

from __future__ import annotations

import torch

from b12x_toolchain.exporter.model.weights import SCALE_SUFFIX, weight_formats
from b12x_toolchain.runtime.ops.opset import ops


def as_float32(t: torch.Tensor) -> torch.Tensor:
    """t in float32; a float32 tensor itself (no node in the graph)."""
    return t if t.dtype == torch.float32 else t.float()


class Linears:
    """The stored format of every weight of a model (Dims) and its activation rule."""

    def __init__(self, d):
        self.formats = weight_formats(d)  # only the weights not in fp32
        self.activation = d.activation

    def quantized(self, name: str) -> bool:
        fmt = self.formats.get(name)
        return fmt is not None and fmt.quantized

    def kind(self, name: str) -> str:
        fmt = self.formats.get(name)
        return "fp32" if fmt is None else fmt.kind

    def value(self, w, name: str) -> torch.Tensor:
        """The float32 value of an unquantized weight (norms, routers, the embedding's rows ...)."""
        if self.quantized(name):
            raise ValueError(f"{name} is stored {self.formats[name].describe()}; it is read through a linear, "
                             "not as a value")
        return as_float32(w[name])

    def __call__(self, w, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear(x, W, bias) with W the weight `name` in its stored format."""
        if not self.quantized(name):
            out = ops.dense_linear(x, as_float32(w[name]))
            return out if bias is None else out + bias
        fmt = self.formats[name]
        if fmt.kind != "fp8_e4m3":
            raise ValueError(f"{name} is stored {fmt.describe()}; only routed experts take fp4_e2m1")
        out = ops.fp8_block_linear(x, w[name], w[name + SCALE_SUFFIX], *fmt.block, self.activation)
        return out if bias is None else out + bias

    def grouped(self, w, name: str, x: torch.Tensor) -> torch.Tensor:
        """x [R, T, G, in] by the grouped weight [G * out, in]: group g's rows take x[.., g, :];
        returns [R, T, G, out]."""
        groups = x.shape[-2]
        if not self.quantized(name):
            weight = as_float32(w[name]).view(groups, -1, x.shape[-1])
            return torch.stack([ops.dense_linear(x[..., g, :], weight[g]) for g in range(groups)], dim=-2)
        fmt = self.formats[name]
        data, scale = w[name], w[name + SCALE_SUFFIX]
        rows, bm = data.shape[0] // groups, fmt.block[0]
        out = []
        for g in range(groups):
            first, last = g * rows, (g + 1) * rows
            # A group's scales are the block rows it spans: whole blocks, or a part of one block.
            if first % bm and first // bm != (last - 1) // bm:
                raise ValueError(f"{name}: group {g}'s rows {first}..{last - 1} start inside a {bm}-row scale block "
                                 "and run into the next; the groups' rows must tile the blocks")
            group_scale = scale[first // bm: -(-last // bm)]
            out.append(ops.fp8_block_linear(x[..., g, :], data[first:last], group_scale, *fmt.block,
                                            self.activation))
        return torch.stack(out, dim=-2)

    def routed(self, w, m: str, x: torch.Tensor, chosen: torch.Tensor, picked: torch.Tensor, local: slice | None,
               activation_fn) -> torch.Tensor:
        """The routed experts' sum for block-scaled experts: only the chosen experts are computed.

        x [R, T, D]; chosen [R, T, K] expert ids over all experts, picked [R, T, K] their
        weights; local: this rank's experts (None: all). A choice of an expert another rank
        holds counts zero here, and the sum over ranks adds it where it is held.
        """
        gate_up, down = m + "experts.gate_up_proj", m + "experts.down_proj"
        for name in (gate_up, down):
            if self.kind(name) != "fp4_e2m1":
                raise ValueError(f"{name} is stored {self.formats[name].describe()}; block-scaled routed experts are "
                                 "computed for fp4_e2m1 only")
        # [R, T * K, ...]: the op's token axis is the rows (the only dynamic size) and its choice
        # axis a token's K choices side by side, so no size is computed from the rows in the graph.
        T, K = chosen.shape[1:]
        ids = chosen.flatten(1)
        weights = picked.flatten(1)
        if local is not None:  # this rank's experts, numbered from 0 here
            ids = ids - local.start
            held = (ids >= 0) & (ids < local.stop - local.start)
            ids = torch.where(held, ids, torch.zeros_like(ids))
            weights = torch.where(held, weights, torch.zeros_like(weights))
        rows = x[:, :, None, :].expand(-1, -1, K, -1).flatten(1, 2)
        h = ops.fp4_expert_linear(rows, ids, w[gate_up], w[gate_up + SCALE_SUFFIX], self.activation)
        h = activation_fn(*h.chunk(2, dim=-1))
        y = ops.fp4_expert_linear(h, ids, w[down], w[down + SCALE_SUFFIX], self.activation)  # [R, T * K, D]
        return (y * weights[..., None]).unflatten(1, (T, K)).sum(dim=2)
