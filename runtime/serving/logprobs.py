"""Log-probabilities of chosen tokens and their top alternatives, from logits on the host.

They are taken from the target's raw logits (before temperature and top-p), as vLLM
reports them by default, in float32 as the logits come; alternatives are ordered most
likely first, ties by token id.
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.serving.requests import TokenLogprob


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """One entry per token: tokens[j]'s log-probability under logits[j] ([len(tokens), V] or
    more rows), with the `top` most likely tokens of that row."""
    if not tokens:
        return []
    rows = torch.log_softmax(logits[: len(tokens)].to(torch.float32), dim=-1)
    chosen = rows.gather(-1, torch.tensor(tokens, dtype=torch.int64).unsqueeze(-1)).squeeze(-1).tolist()
    if top == 0:
        return [TokenLogprob(value) for value in chosen]
    # topk's order among equal values is unspecified: sort by (-logprob, id) on the host.
    values, ids = rows.topk(min(top, rows.shape[-1]), dim=-1)
    out = []
    for value, row_values, row_ids in zip(chosen, values.tolist(), ids.tolist()):
        ranked = sorted(zip(row_ids, row_values), key=lambda item: (-item[1], item[0]))
        out.append(TokenLogprob(value, tuple(ranked)))
    return out
