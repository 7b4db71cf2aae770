"""Training the DSpark drafter on the target's hidden states to predict the next block.

The draft pass sees, for an anchor token at position a, the stages' context rows of the
`history` positions before a (each a projection of the target's hidden states there) and
the block [anchor, noise...]; its row j is to name the token the target would emit at
a + 1 + j. The labels are the target's own greedy choices (argmax of its logits at
a + j, teacher-forced on the sequence), so the drafter learns the target, not the corpus:
on sequences the target generated itself they are exactly the tokens that follow.
Only the drafter's weights (`dspark.*`, the stages' `mtp.*`) train; the embedding and
LM head it shares with the target stay as trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from b12x_toolchain.exporter.train.language_model import forward_sequences
from b12x_toolchain.exporter.train.training_io import DraftBlockIO
from b12x_toolchain.exporter.train.training_ops import differentiable_ops

DRAFTER_PREFIXES = ("dspark.", "mtp.")
ROW_DECAY = 0.8  # later rows count less: a draft row is used only when every row before it was accepted


def drafter_weight_names(weights: dict) -> list[str]:
    return sorted(name for name in weights if name.startswith(DRAFTER_PREFIXES))


@dataclass
class DraftData:
    """Sequences [N, L], the target's hidden states for the drafter [N, L, H] (bfloat16) and its
    greedy next token at each position [N, L]."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    labels: torch.Tensor


@torch.no_grad()
def draft_data(module, weights: dict, sequences: torch.Tensor, rows: int = 16) -> DraftData:
    hidden, labels = [], []
    for first in range(0, len(sequences), rows):
        batch = sequences[first : first + rows]
        logits, taps = forward_sequences(module, weights, batch)
        hidden.append(module.drafter.main_hidden(taps).to(torch.bfloat16))
        labels.append(logits.argmax(dim=-1))
    return DraftData(sequences, torch.cat(hidden), torch.cat(labels))


def _context(module, weights, data: DraftData, seqs: torch.Tensor, anchors: torch.Tensor) -> list[torch.Tensor]:
    """Each stage's context rows [B, history, D] before each anchor (zeros before position 0)."""
    d = module.d
    L = data.tokens.shape[1]
    pos = torch.arange(L).expand(len(seqs), -1)
    keys = list(module.drafter.context_keys(weights, module.angles(pos), data.hidden[seqs].float()))
    at = anchors[:, None] + torch.arange(-d.history, 0)
    inside = (at >= 0)[..., None]
    return [torch.where(inside, k.gather(1, at.clamp(min=0)[..., None].expand(-1, -1, k.shape[-1])), 0.0)
            for k in keys]


def draft_loss(module, weights: dict, data: DraftData, seqs: torch.Tensor, anchors: torch.Tensor):
    """(loss, accepted-row accuracy): rows' cross-entropy against the target's choices, plus the
    confidence head's against whether the row's argmax is right."""
    d = module.d
    W = d.draft_width
    block = torch.full((len(anchors), W), d.noise_token_id, dtype=torch.int64)
    block[:, 0] = data.tokens[seqs, anchors]
    labels = data.labels[seqs[:, None], anchors[:, None] + torch.arange(W)]  # [B, W]
    with differentiable_ops():
        io = DraftBlockIO(d, anchors, _context(module, weights, data, seqs, anchors))
        logits, confidence = module.drafter.block(weights, io, anchors, block)
        prev = torch.cat([block[:, :1], labels[:, :-1]], dim=1)  # teacher-forced Markov inputs
        logits = logits + torch.stack([module.drafter.markov_bias(weights, prev[:, j]) for j in range(W)], dim=1)
    decay = ROW_DECAY ** torch.arange(W, dtype=torch.float32)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(-1, W)
    right = (logits.argmax(dim=-1) == labels).float()
    bce = F.binary_cross_entropy(confidence.clamp(1e-6, 1 - 1e-6), right, reduction="none")
    loss = ((ce + 0.1 * bce) * decay).sum(dim=1).mean() / decay.sum()
    return loss, right.cumprod(dim=1).sum(dim=1).mean()


def sample_anchors(data: DraftData, sequences: int, per_sequence: int, draft_width: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence ids, anchor positions) [sequences * per_sequence], each block inside its sequence."""
    N, L = data.tokens.shape
    seqs = torch.randint(0, N, (sequences,), generator=generator).repeat_interleave(per_sequence)
    anchors = torch.randint(1, L - draft_width, (len(seqs),), generator=generator)
    return seqs, anchors
