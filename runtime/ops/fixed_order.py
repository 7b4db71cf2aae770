"""Arithmetic whose order a row's shape fixes, not the call that computes it.

A token's numbers must not depend on the pass, bucket, batch or slot that computed them:
then decoding, verifying and prefilling a token give the same bits, the caches hold the
same bytes whichever pass wrote them, and speculative decoding at temperature 0 is greedy
decoding to the bit. On CPU, torch rounds a row differently by the call around it:

* a matrix product picks its kernel by the number of rows (a matrix-vector product for
  one row, small-matrix paths below 16 rows, and a key count below 16 is another path);
* a softmax or a sum over keys groups its terms by the row's length, and the passes hold a
  query's keys at other offsets of rows of other lengths (decode: 127 history rows and one
  new one; verify: 128 and eight; prefill: 127 and a chunk);
* some vectorised activations (sigmoid, SiLU, softplus) take a scalar path for a tensor's
  tail, so a value's result depends on where it sits in the tensor.

What is invariant here (tests/runtime/ops/test_row_invariance.py holds each of these):
reductions over the last axis of a fixed length (norms, softmax over a fixed group, sums
over a head or a feature axis); elementwise `exp`, `log`, `sqrt`, `rsqrt`, `sin`, `cos`;
a matrix product whose rows are padded to whole tiles of `ROW_TILE` (at least one) and
whose other side keeps its size; and a sum taken one term after another (or block after
block of positions), where a term that is exactly zero (a key a query does not see) changes
nothing, so the sum over a query's keys is the same wherever and among however many masked
keys they sit.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

ROW_TILE = 16
"""Rows of a matrix product are padded to a multiple of this (one tile at least): every row
then goes through the same kernel, whatever the number of rows in the call."""
KEY_BLOCK = 16
"""Positions per block of a weighted sum over keys (`weighted_rows`)."""
_exact = [True]


@contextmanager
def shape_dependent():
    """Inside the block, the products and sums here take whatever arithmetic torch picks for
    the shape, as the op set did before it was exact: only for measuring what exactness
    costs (benchmarks/trained_model.py), never for serving."""
    saved, _exact[0] = _exact[0], False
    try:
        yield
    finally:
        _exact[0] = saved


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T [out, in] -> [..., out], every row through one kernel.

    The rows are padded with zeros to whole tiles and the weight's rows to one tile at
    least: a row's result is then the same in a call of 1, 2 or 1,000 rows (BLAS takes
    another path for one row and for a few), and against 16 or 1,000 keys.
    """
    if not _exact[0]:
        return F.linear(x, weight)
    flat = x.reshape(-1, x.shape[-1])
    rows, outputs = flat.shape[0], weight.shape[0]
    padded = max(ROW_TILE, -(-rows // ROW_TILE) * ROW_TILE)
    if padded != rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    if outputs < ROW_TILE:
        weight = torch.cat([weight, weight.new_zeros(ROW_TILE - outputs, weight.shape[1])])
    return F.linear(flat, weight)[:rows, :outputs].contiguous().view(*x.shape[:-1], outputs)


def dot_last(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) with broadcasting: each dot product is one fixed-length reduction."""
    return (a * b).sum(dim=-1)


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum along `dim`, term after term in index order.

    Zeros add nothing to a sum taken term by term, so terms at masked places do not move
    the result: the sum over a query's keys is the same wherever and among however many
    masked keys they sit, as long as the keys it sees come in the same order. (torch's
    cumulative sum runs along the axis one term at a time; on CPU it carries a float32
    tensor's sum in float64.)
    """
    return x.cumsum(dim).select(dim, -1) if _exact[0] else x.sum(dim)


def weighted_rows(weights: torch.Tensor, rows: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """sum_j weights[r, ..., j] * rows[r, j, :] -> [R, ..., D], row j of r at position first[r] + j.

    weights [R, ..., J], rows [R, J, D], first [R]. The terms are summed in blocks of
    KEY_BLOCK positions (position // KEY_BLOCK: the same blocks in every pass, each term at
    the same place of its block), then block after block (`ordered_sum`): a query's result
    does not depend on where the pass holds its keys or on the masked ones around them.
    """
    R, J, D = rows.shape
    if not _exact[0]:
        return torch.matmul(weights, rows.view(R, *(1,) * (weights.dim() - 3), J, D))
    shift = torch.remainder(first.long(), KEY_BLOCK)
    span = -(-(J + KEY_BLOCK - 1) // KEY_BLOCK) * KEY_BLOCK
    source = torch.arange(span, device=rows.device) - shift[:, None]  # [R, span]: the row at each place, if any
    held = (source >= 0) & (source < J)
    source = source.clamp(0, J - 1)
    aligned = torch.where(held[..., None], rows.gather(1, source[..., None].expand(-1, -1, D)), 0.0)
    middle = weights.shape[1:-1]
    at = source.view(R, *(1,) * len(middle), span).expand(R, *middle, span)
    w = torch.where(held.view(R, *(1,) * len(middle), span), weights.gather(-1, at), 0.0)
    terms = w[..., None, :] * aligned.transpose(1, 2).reshape(R, *(1,) * len(middle), D, span)
    return ordered_sum(terms.unflatten(-1, (span // KEY_BLOCK, KEY_BLOCK)).sum(dim=-1), -1)


def softmax_last(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis whose denominator is an `ordered_sum` (see there)."""
    if not _exact[0]:
        return torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)
    e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    return e / ordered_sum(e, -1).unsqueeze(-1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) from `exp`, which rounds a value the same wherever it sits."""
    return torch.reciprocal(torch.exp(-x) + 1.0)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), and x itself above 20 (as torch's softplus)."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.clamp(x, max=20.0))))
