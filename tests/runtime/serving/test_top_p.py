"""Top-p (nucleus) sampling: the truncation itself, and speculative sampling over truncated p and q.

Truncating the draft's q and the target's p alike keeps speculative sampling exact: the
first emitted token follows the truncated target distribution, whatever q is.
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.serving.sampling import accept_sampled, nucleus, probabilities
from chi_square import chi_square_p_value

SEED = 99
P_VALUE = 1e-3  # a correct sampler fails this test once in a thousand seeds; this seed passes


def test_nucleus_keeps_the_most_likely_tokens_reaching_top_p():
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15], dtype=torch.float64)
    assert torch.allclose(nucleus(probs, 0.5), torch.tensor([0, 1.0, 0, 0], dtype=torch.float64))
    assert torch.allclose(nucleus(probs, 0.75), torch.tensor([0, 0.625, 0.375, 0], dtype=torch.float64))
    assert torch.allclose(nucleus(probs, 0.81), torch.tensor([0, 0.5, 0.3, 0.15], dtype=torch.float64) / 0.95)
    assert torch.equal(nucleus(probs, 0.01), torch.tensor([0, 1.0, 0, 0], dtype=torch.float64))  # never empty
    batch = torch.stack([probs, probs.flip(0)])
    assert torch.allclose(nucleus(batch, 0.75)[1], nucleus(probs, 0.75).flip(0))
    logits = torch.log(probs)
    assert torch.allclose(probabilities(logits, 1.0, 0.75), nucleus(probs, 0.75))
    assert torch.allclose(probabilities(logits, 1.0), probs)


def test_speculative_sampling_with_top_p_follows_the_truncated_target():
    gen = torch.Generator().manual_seed(SEED)
    vocab, width, top_p, samples = 16, 3, 0.7, 8000
    target_logits = torch.randn(width + 1, vocab, generator=gen)
    p = probabilities(target_logits, 1.0, top_p)
    q = probabilities(torch.randn(width, vocab, generator=gen), 1.0, top_p)
    overlap = float(torch.minimum(p[0], q[0]).sum())
    assert overlap < 0.9, f"p and q overlap {overlap:.2f}: too similar for the test to tell samplers apart"
    drafts = torch.multinomial(q, samples, replacement=True, generator=gen).T.tolist()
    first = [accept_sampled(row, q, p, gen)[0] for row in drafts]
    assert all(p[0, t] > 0 for t in first), "a token outside the target's nucleus was emitted"
    support = p[0].nonzero().flatten().tolist()  # the test's bins: tokens the nucleus keeps
    assert chi_square_p_value([support.index(t) for t in first], p[0, support]) > P_VALUE
    # The untruncated target differs visibly, so the test tells the two apart.
    assert chi_square_p_value(first, probabilities(target_logits, 1.0)[0]) < 1e-9
