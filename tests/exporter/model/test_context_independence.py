"""A pass costs what the request holds: `max_seq_len` sizes the caches and nothing else.

The same small DeepSeek V4.1 model exported for 1,024 and for 65,536 positions must give
the same logits to the bit and the same tokens for the same request, and its graphs must
be the same graphs: no node other than a cache input has a size that follows
`max_seq_len / ratio` (op set v1 gathered, decoded and masked every entry a cache could
hold, so its graphs had exactly such nodes).
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.serving.speculative import Decoder
from conftest import LONG_CONTEXT as LONG
from conftest import random_tokens
from decode_steps import incremental

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow(minutes=0.4)]


@pytest.fixture(scope="module")
def long_pkg(long_path):
    return load(long_path)


def _walk(pkg, pass_name):
    graph = pkg.passes[pass_name].program.graph
    for node in graph.nodes:
        if node.op == "call_function":
            vals = node.meta.get("val")
            for val in vals if isinstance(vals, (list, tuple)) else [vals]:
                if isinstance(val, torch.Tensor):
                    yield node, tuple(int(s) for s in val.shape)


def test_same_weights_and_calling_convention_but_for_cache_sizes(small_pkg, long_pkg):
    assert small_pkg.manifest.files["weights.safetensors"] == long_pkg.manifest.files["weights.safetensors"]
    assert long_pkg.manifest.model.max_seq_len == LONG
    grown = set()
    for name, info in small_pkg.passes.items():
        short, long = info.inputs, long_pkg.passes[name].inputs
        assert [s.name for s in short] == [s.name for s in long]
        grown |= {s.name for s, t in zip(short, long) if s.shape != t.shape}
    # Only the block tables grow ([rows, pages_per_slot]); paged caches are [pool, page_bytes] at any size.
    assert grown == {"entry_block_table", "index_key_block_table"}, grown


def test_no_node_scales_with_max_seq_len(small_pkg, long_pkg):
    ratios = [r for r in long_pkg.manifest.recipe["model"]["compress_ratios"] if r]
    bound = LONG // max(ratios)  # the smallest count of entries a cache of this package holds
    for name in long_pkg.passes:
        big = [(n.name, str(n.target), shape) for n, shape in _walk(long_pkg, name) if any(s >= bound for s in shape)]
        assert big == [], f"{name}: nodes sized by max_seq_len: {big[:5]}"
        # and the graph is the same graph at either size
        assert [str(n.target) for n, _ in _walk(long_pkg, name)] == [str(n.target) for n, _ in _walk(small_pkg, name)]


def test_same_request_same_logits_and_tokens_at_1k_and_64k(small_pkg, long_pkg):
    gen = torch.Generator().manual_seed(150)
    sequences = [random_tokens(gen, 190), random_tokens(gen, 175)]
    short, long = incremental(small_pkg, sequences, [150, 131]), incremental(long_pkg, sequences, [150, 131])
    for a, b in zip(short, long):
        assert a.shape[0] >= 160 and torch.equal(a, b)
    prompt = sequences[0][:150]
    tokens = [Decoder(pkg.session(slots=1, max_rows=1)).generate([prompt], 24)[0] for pkg in (small_pkg, long_pkg)]
    assert len(tokens[0]) == 24 and tokens[0] == tokens[1]
