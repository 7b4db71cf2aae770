"""Drafts from the draft pass, computed on the device: the verify block is built there from
the draft pass's outputs, so a speculative step never waits for the device before verify."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from b12x_toolchain.runtime.serving.sampling import draw_inverse, probabilities_on_device
from b12x_toolchain.runtime.session.transfers import to_device
from b12x_toolchain.runtime.session.validate import OnDevice


@dataclass
class Drafts:
    """A group's drafts. `block` is verify's token_ids (host lists, or an OnDevice tensor);
    drafts known on the host are in `host` (one list per row, already cut to its length),
    drafts left on the device in `ids` [rows, width] with how many of each row count, `kept`
    [rows]; `q` holds
    the draft distributions [sampled rows, width, vocab] (float64, on the device) that sampled
    rows drew from, None when no row sampled from the draft pass."""

    block: object
    host: list[list[int]] | None = None
    ids: torch.Tensor | None = None
    kept: torch.Tensor | None = None
    q: torch.Tensor | None = None


def confident_lengths(out: dict, manifest) -> torch.Tensor:
    """Per row, how many drafted tokens precede the first one whose confidence (DSpark's
    sigmoid head) is below the package's threshold: an int64 tensor on the outputs' device.
    `manifest`: the package's typed Manifest (runtime/package/manifest.py)."""
    logits = out["logits"]
    rows, width = logits.shape[:2]
    threshold = manifest.model.confidence_threshold
    if "confidence" not in out or threshold <= 0:
        return torch.full((rows,), width, dtype=torch.int64, device=logits.device)
    low = out["confidence"] < threshold
    # index of the first low row, or width when there is none
    return torch.where(low.any(dim=1), low.to(torch.int64).argmax(dim=1), width)


def device_drafts(out: dict, manifest, pending: list[int], noise: int, generator_rows) -> Drafts:
    """Drafts of a draft pass's outputs, on their device: the argmax for greedy rows, a draw
    from q for sampled ones (`generator_rows`: (row index, temperature, top_p, generator) of
    each sampled row), and verify's block [pending, drafts..., noise past each row's length].

    Sampled rows draw by inverse CDF from uniforms their own CPU generator makes (draft width
    of them per step, whatever the row's length), so a seed fixes the draws on any device."""
    logits = out["logits"]
    device, width = logits.device, logits.shape[1]
    tokens = logits.argmax(-1)
    lengths = confident_lengths(out, manifest)
    q = None
    if generator_rows:
        q = torch.stack([probabilities_on_device(logits[i], t, p) for i, t, p, _ in generator_rows])
        uniforms = torch.stack([torch.rand(width, generator=g, dtype=torch.float64, device=g.device) for *_, g in generator_rows])
        index = to_device([i for i, *_ in generator_rows], torch.int64, device)
        tokens = tokens.index_copy(0, index, draw_inverse(q, to_device(uniforms, torch.float64, device)))
    columns = torch.arange(width, device=device)
    body = torch.where(columns[None, :] < lengths[:, None], tokens, noise)
    block = torch.cat([to_device(pending, torch.int64, device)[:, None], body], dim=1)
    return Drafts(block=OnDevice(block), ids=tokens, kept=lengths, q=q)
