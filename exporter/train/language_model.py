"""The target's next-token objective on token streams, through the exported model's own layers.

`forward_sequences` runs the prefill pass's layer code (exporter/model/pass_modules.py)
over whole sequences from position 0 with the op set made differentiable
(training_ops.py) and the cache reads replaced by the rows themselves (training_io.py):
what a replay computes, quantized caches included, with gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from b12x_toolchain.exporter.train.training_io import SequenceIO, empty_caches
from b12x_toolchain.exporter.train.training_ops import differentiable_ops


def token_stream(tokenizer, texts, eos_id: int) -> torch.Tensor:
    """int64 [N]: every text's tokens, each text followed by the end-of-text token."""
    ids = []
    for encoding in tokenizer.encode_batch(list(texts)):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def random_crops(stream: torch.Tensor, rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, length] windows of the stream at random offsets."""
    starts = torch.randint(0, len(stream) - length, (rows,), generator=generator)
    return stream[starts[:, None] + torch.arange(length)]


def forward_sequences(module, weights: dict, tokens: torch.Tensor, distillation=None):
    """(logits [R, T, V], taps by layer): the target over sequences [R, T] from position 0
    (`distillation`: an IndexerDistillation that collects the indexers' losses)."""
    R, T = tokens.shape
    io = SequenceIO(module.d, R, T, tokens.device)
    with differentiable_ops(distillation):
        logits, _, taps = module.target(weights, io, empty_caches(module.d, tokens.device), tokens, io.pos,
                                        io.positions)
    return logits, taps


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) of each position's logits against the token after it."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@dataclass(frozen=True)
class Schedule:
    steps: int
    peak_lr: float
    warmup: int
    min_ratio: float = 0.1

    def lr(self, step: int) -> float:
        """Linear warm-up, then cosine decay to min_ratio of the peak."""
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.peak_lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def trainable(weights: dict, names) -> list[torch.Tensor]:
    """The float tensors among `names`, made leaves that take gradients (int tables stay as they are)."""
    out = []
    for name in names:
        tensor = weights[name]
        if tensor.is_floating_point():
            tensor.requires_grad_(True)
            out.append(tensor)
    return out


def optimise(params: list[torch.Tensor], schedule: Schedule, loss_of_step, log=None, weight_decay: float = 0.01,
             clip: float = 1.0) -> list[float]:
    """AdamW over `params` for schedule.steps steps of `loss_of_step(step) -> loss`; the losses."""
    optimiser = torch.optim.AdamW(params, lr=schedule.peak_lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    losses = []
    for step in range(schedule.steps):
        for group in optimiser.param_groups:
            group["lr"] = schedule.lr(step)
        loss = loss_of_step(step)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, clip)
        optimiser.step()
        losses.append(float(loss.detach()))
        if log is not None:
            log(step, losses[-1])
    return losses


@torch.no_grad()
def perplexity(module, weights: dict, stream: torch.Tensor, length: int, rows: int = 16) -> float:
    """exp(mean next-token loss) over the stream's consecutive windows of `length` tokens."""
    usable = (len(stream) // length) * length
    windows = stream[:usable].view(-1, length)
    total, count = 0.0, 0
    for first in range(0, len(windows), rows):
        batch = windows[first : first + rows]
        logits, _ = forward_sequences(module, weights, batch)
        n = batch.shape[0] * (length - 1)
        total += float(next_token_loss(logits, batch)) * n
        count += n
    return math.exp(total / count)
