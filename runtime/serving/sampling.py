"""Choosing tokens from logits: greedy, seeded sampling, and speculative acceptance.

Greedy acceptance keeps the longest draft prefix the target's argmax agrees with, then
the target's own next token. Sampled acceptance is speculative sampling: draft d_j,
drawn from the draft distribution q_j, is kept with probability min(1, p_j(d_j) / q_j(d_j));
the first rejected position draws from normalize(max(0, p_j - q_j)) instead, and when
every draft is kept the bonus token draws from the target's next distribution. Each
emitted token is then distributed exactly as the target's p, whatever q is, so a bad
drafter costs speed, never fidelity.

Top-p (nucleus) sampling keeps the smallest set of most likely tokens whose mass reaches
top_p and renormalizes. The engine truncates the draft's q and the target's p alike, so
speculative sampling emits tokens distributed exactly as the truncated target.

All randomness comes from a caller's `torch.Generator` (one per request), so a seed
fixes the output whatever else shares the batch.
"""

from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    # float64: the acceptance ratio p/q of two small probabilities must not round to 0 or inf.
    # On the CPU: request generators are CPU generators, so a seed draws the same on any device.
    return probabilities_on_device(logits.to("cpu"), temperature, top_p)


def probabilities_on_device(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """`probabilities` computed where the logits are (float64 too): the draft distributions
    sampled rows draw from on the device, which acceptance then reads back as they are."""
    probs = torch.softmax(logits.to(torch.float64) / temperature, dim=-1)
    return nucleus(probs, top_p) if top_p < 1.0 else probs


def draw_inverse(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per distribution of `probs` [..., V], by inverse CDF at `uniforms` [...] in
    [0, 1): the first token whose cumulative mass exceeds u * total. A token of no mass never
    is (its cumulative mass equals its predecessor's); the clamp absorbs rounding at the top."""
    cdf = probs.cumsum(-1)
    point = (uniforms * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def top_two_gap(logits: torch.Tensor) -> torch.Tensor:
    """`margin` of every row of logits [..., V], computed where they are."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` (last dim: the vocabulary) cut to the most likely tokens holding top_p of the mass, renormalized.

    A token is kept when the mass of the tokens more likely than it is still below top_p, so
    the most likely token always stays and the set just reaches top_p."""
    ordered, order = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(-1) - ordered
    kept = torch.zeros_like(probs).scatter(-1, order, (before < top_p).to(probs.dtype))
    truncated = probs * kept
    return truncated / truncated.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=gen))


def pick(logits: torch.Tensor, temperature: float, gen: torch.Generator | None, top_p: float = 1.0) -> int:
    """One token from one row of logits: the argmax at temperature 0, else a seeded draw."""
    if temperature == 0:
        return int(logits.argmax())
    return draw(probabilities(logits, temperature, top_p), gen)


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """Emitted tokens for one row: the accepted drafts (equal to the target's picks) plus the bonus.

    targets[j] is the target's argmax after draft j (row 0: after the pending token), so
    len(targets) >= len(drafts) + 1.
    """
    k = 0
    while k < len(drafts) and drafts[k] == targets[k]:
        k += 1
    return targets[: k + 1]


def accept_sampled(drafts: list[int], q: torch.Tensor | None, p: torch.Tensor, gen: torch.Generator) -> list[int]:
    """Speculative sampling for one row; p: [k + 1, V] target probabilities, q: [k, V] draft ones.

    q None means the drafter is deterministic (q_j is one-hot on d_j): d_j is then kept
    with probability p_j(d_j), and a rejection redraws from p_j without d_j.
    """
    out = []
    for j, token in enumerate(drafts):
        q_token = 1.0 if q is None else float(q[j, token])
        p_token = float(p[j, token])
        # u < p/q, written without the division: q_token == 0 keeps any draft p allows.
        if float(torch.rand((), generator=gen, dtype=torch.float64, device=gen.device)) * q_token < p_token:
            out.append(token)
            continue
        if q is None:
            residual = p[j].clone()
            residual[token] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_min(0.0)
        # A rejection implies p_j != q_j, so the residual has mass; rounding aside, p_j is the limit.
        total = float(residual.sum())
        out.append(draw(residual / total if total > 0 else p[j], gen))
        return out
    out.append(draw(p[len(drafts)], gen))
    return out


def margin(logits: torch.Tensor) -> float:
    """Gap between the two largest logits: how close the argmax was to a tie."""
    top = logits.topk(2).values
    return float(top[0] - top[1])
