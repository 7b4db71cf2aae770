"""The op set made differentiable, for training the model the exporter captures.

The passes call every cache access and kernel through the op set's torch namespace, whose
kernels are opaque to autograd (define.py registers them for inference). Training runs the
same layer code with `ops` swapped, in the model's modules, for the ops' plain-torch
references: attention, mHC and the Engram lookup are differentiable as written; a cache
format's round trip passes the gradient straight through (the forward still sees the
quantized values a replay reads); choices (top-k ids, hashes) and writes carry none.

The lightning indexer's choice carries no gradient either, so it is trained apart, as
DeepSeek trains it in its dense warm-up: `IndexerDistillation` takes, for each indexer,
the KL divergence from the main attention's distribution over every compressed entry a
query may see (its heads' probabilities averaged, no gradient) to the softmax of the
indexer's scores over the same entries. The loss reaches the indexer's own weights and,
through them, the query latent and entry latent it reads (the training adds it with a
small weight, see pipeline.py).
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from types import SimpleNamespace

import torch

from b12x_toolchain.runtime.ops import engram_ops, mhc_ops, opset, quant_ops, sparse_ops


def straight_through_round_trip(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """decode(encode(values)) forward, identity backward."""
    quantized = opset.round_trip(values.detach(), fmt)
    return values + (quantized - values).detach()


def _no_grad(fn):
    def call(*args, **kwargs):
        with torch.no_grad():
            return fn(*args, **kwargs)
    return call


class IndexerDistillation:
    """`indexer_topk` and `sparse_attention` that also record the indexer's KL (module docstring)."""

    def __init__(self):
        self.losses: list[torch.Tensor] = []
        self._scores = None  # the last indexer's scores [R, T, n], until its attention reads them

    def indexer_topk(self, q, head_weights, index_cache, new_keys, block_table, positions, candidates, ratio,
                     block_size, topk, fmt):
        with torch.no_grad():
            ids = sparse_ops.indexer_topk(q, head_weights, index_cache, new_keys, block_table, positions, candidates,
                                          ratio, block_size, topk, fmt)
        self._scores = torch.stack([sparse_ops._row_scores(q, head_weights, index_cache, new_keys, block_table,
                                                           positions, r, ratio, fmt)[1] for r in range(q.shape[0])])
        return ids

    def sparse_attention(self, q, window, window_visible, sinks, entry_cache, new_entries, block_table, positions,
                         indices, ratio, fmt):
        if indices is not None and self._scores is not None:
            self.losses.append(self._kl(q, new_entries, self._scores, ratio))
            self._scores = None
        return sparse_ops.sparse_attention(q, window, window_visible, sinks, entry_cache, new_entries, block_table,
                                           positions, indices, ratio, fmt)

    @staticmethod
    def _kl(q, new_entries, scores, ratio: int) -> torch.Tensor:
        """Sequences from position 0: entry j is the pass row (j + 1) * ratio - 1's."""
        entries = new_entries[:, ratio - 1 :: ratio].float()[:, : scores.shape[-1]]  # [R, n, D]
        seen = torch.isfinite(scores)  # [R, T, n]
        rows = seen.any(dim=-1)  # queries that see at least one entry
        with torch.no_grad():
            logits = torch.einsum("rthd,rnd->rthn", q.float(), entries) * q.shape[-1] ** -0.5
            logits = logits.masked_fill(~seen[:, :, None, :], float("-inf"))
            target = torch.nan_to_num(logits.softmax(dim=-1)).mean(dim=2)  # [R, T, n]
        log_p = scores.masked_fill(~seen, float("-inf")).log_softmax(dim=-1)
        kl = torch.where(seen, target * (torch.log(target.clamp_min(1e-9)) - log_p), 0.0).sum(dim=-1)
        return kl[rows].mean()


def training_ops(distillation: IndexerDistillation | None = None) -> SimpleNamespace:
    """The op set's names bound to differentiable references (or gradient-free ones)."""
    ops = {name: getattr(module, name) for module, names in (
        (sparse_ops, ("sparse_attention",)), (engram_ops, ("engram_lookup",)),
        (quant_ops, ("dense_linear", "fp8_block_linear", "fp4_expert_linear")),
    ) for name in names}
    for module, names in ((sparse_ops, ("indexer_topk", "candidate_blocks")), (engram_ops, ("engram_hash",)),
                          (opset, ("window_snapshot", "cache_append", "window_snapshot_append", "window_read",
                                   "window_commit", "write_rows", "write_slots", "gather_rows", "stage_rows",
                                   "read_rows", "set_seq_len"))):
        ops.update({name: _no_grad(getattr(module, name)) for name in names})
    ops["round_trip"] = straight_through_round_trip
    ops["hc_sinkhorn"] = mhc_ops.sinkhorn_unfused  # the op's own steps, out of place
    if distillation is not None:
        ops["indexer_topk"], ops["sparse_attention"] = distillation.indexer_topk, distillation.sparse_attention
    return SimpleNamespace(**ops)


def _model_modules():
    import b12x_toolchain.exporter.model as model
    for info in pkgutil.iter_modules(model.__path__):
        module = importlib.import_module(f"{model.__name__}.{info.name}")
        if getattr(module, "ops", None) is opset.ops:
            yield module


@contextlib.contextmanager
def differentiable_ops(distillation: IndexerDistillation | None = None):
    """Within: the model's modules call `training_ops(distillation)` instead of the registered op set."""
    swapped = training_ops(distillation)
    modules = list(_model_modules())
    for module in modules:
        module.ops = swapped
    try:
        yield swapped
    finally:
        for module in modules:
            module.ops = opset.ops
