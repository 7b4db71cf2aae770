"""RoPE as shared tables: the reference's pairwise rotation bit for bit, in fewer graph nodes."""

from __future__ import annotations

import torch

from b12x_toolchain.exporter.model.blocks import inv_freq, rope, rope_angles


def pairwise(x, cos, sin):
    """The reference's form: (x1, x2) -> (x1*c - x2*s, x2*c + x1*s) per channel pair."""
    width = 2 * cos.shape[-1]
    nope, r = x[..., :-width], x[..., -width:]
    x1, x2 = r[..., 0::2], r[..., 1::2]
    return torch.cat([nope, torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)], dim=-1)


def angles(pos, freqs):
    angle = pos.to(torch.float32)[..., None] * freqs
    return angle.cos(), angle.sin()


def test_rotation_equals_the_pairwise_reference_bitwise():
    gen = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 1 << 20, (3, 9), generator=gen)
    freqs = inv_freq(160000.0, 16, (16.0, 64, 32, 1), None)
    cos, sin = angles(pos, freqs)
    rotation = rope_angles(pos, freqs)
    x = torch.randn(3, 9, 4, 40, generator=gen)
    x[0, 0, 0, -1] = 0.0
    x[0, 0, 0, -2] = -0.0  # signed zeros keep their sign
    heads = (cos[:, :, None], sin[:, :, None])
    assert torch.equal(rope(x, rotation.heads()), pairwise(x, *heads))
    assert torch.equal(rope(x, rotation.heads()).signbit(), pairwise(x, *heads).signbit())
    assert torch.equal(rope(x[:, :, 0], rotation), pairwise(x[:, :, 0], cos, sin))
    # The output rotation turns back by the same angles (K = V carried RoPE into the output).
    assert torch.equal(rope(x, rotation.heads().inverse()), pairwise(x, cos[:, :, None], -sin[:, :, None]))
    # All channels rotated (no unrotated part) works too.
    assert torch.equal(rope(x[..., :16], rotation.heads()), pairwise(x[..., :16], *heads))


def test_tables_are_built_once_per_rotation():
    rotation = rope_angles(torch.arange(4)[None], inv_freq(10000.0, 8, None, None))
    assert rotation.heads() is rotation.heads()
    assert rotation.heads().inverse() is rotation.heads().inverse()


def test_a_rotation_call_traces_to_fewer_nodes_than_the_pairwise_form():
    pos = torch.arange(8)[None]
    freqs = inv_freq(10000.0, 16, None, None)
    rotation = rope_angles(pos, freqs)
    cos, sin = angles(pos, freqs)
    x = torch.randn(1, 8, 4, 32)

    def nodes(fn):
        graph = torch.fx.experimental.proxy_tensor.make_fx(fn)(x)
        return sum(1 for n in graph.graph.nodes if n.op == "call_function")

    shared = rotation.heads()
    ours = nodes(lambda v: rope(v, shared))
    theirs = nodes(lambda v: pairwise(v, cos[:, :, None], sin[:, :, None]))
    assert ours < theirs, (ours, theirs)
