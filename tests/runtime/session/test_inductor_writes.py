"""The compiled replay writes a cache in place, even where the pass read it first.

A pass reads a window ring's history rows, then writes its new rows over the ring. The
compiled graph must keep that order and update the caller's cache directly: a clone of
the whole cache per replay (what Inductor does when it moves the read past the write)
would make every replay cost the cache's size rather than the request's.
"""

from __future__ import annotations

import re

import torch
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.formats.layout import history_offsets, ring_index
from b12x_toolchain.runtime.ops.opset import ops
from b12x_toolchain.runtime.session import compiled
from b12x_toolchain.runtime.session.compiled import CompiledGraph

FMT, DIM = "dsv41_mxfp8", 64


def _read_then_write(ring, rows, row_ids, positions, valid):
    """A pass's window layer in small: read the history rows, then write new rows over the ring."""
    old = ops.gather_rows.default(ring, row_ids, positions.long()[:, None] + history_offsets(4, ring.device), DIM, FMT)
    index = ring_index(positions, torch.arange(rows.shape[1]), ring.shape[1])
    ops.write_rows.default(ring, rows, row_ids, index, valid, FMT)
    return old.sum(dim=1)


def _inputs(ring):
    gen = torch.Generator().manual_seed(4)
    rows, valid = torch.randn(2, 6, DIM, generator=gen), torch.ones(2, 6, dtype=torch.bool)
    return ring, rows, torch.tensor([1, 0], dtype=torch.int32), torch.tensor([6, 9], dtype=torch.int32), valid


def _compiled_code(directory, args) -> tuple[torch.Tensor, str]:
    """Compile the graph of _read_then_write fresh in `directory`, run it on args; (output, generated code)."""
    graph = make_fx(_read_then_write)(args[0].clone(), *args[1:])
    out, code = run_and_get_code(CompiledGraph(graph, directory), *args)
    return out, "\n".join(code)


def _largest_buffer(code: str) -> int:
    """The most elements of a buffer the graph allocates: `empty_strided_cpu((sizes), ...)` in a
    Python wrapper, `aoti_torch_empty_strided(ndim, int_array_K, ...)` with K's sizes defined
    above it in a C++ one (compiled.CPU_CONFIG)."""
    arrays = dict(re.findall(r"(int_array_\d+)\[\] = \{([\dL, ]*)\}", code))
    shapes = re.findall(r"empty_strided_cpu\(\(([\d, ]*)\)", code)
    shapes += [arrays[name] for name in re.findall(r"aoti_torch_empty_strided\(\d+, (int_array_\d+)", code)]
    assert shapes, "no buffer allocation found in the generated code"
    return max(torch.Size(int(d.strip().rstrip("L")) for d in s.split(",") if d.strip()).numel() for s in shapes)


def test_compiled_write_after_read_updates_the_cache_in_place(tmp_path, monkeypatch):
    ring = get_format(FMT).encode(torch.randn(3, 32, DIM, generator=torch.Generator().manual_seed(5)))
    want_ring = ring.clone()
    want = _read_then_write(*_inputs(want_ring))

    out, code = _compiled_code(tmp_path / "kept", _inputs(ring))
    assert torch.equal(ring, want_ring)  # the history was read before the new rows replaced it
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert _largest_buffer(code) < ring.numel(), "the compiled graph allocates a cache-sized buffer"
    # The write's format goes to it as an integer, through the C shim: no boxed dispatcher call,
    # whose headers cost the compiler 7 s a graph (code_string_arguments.py).
    assert "aoti_torch_call_dispatcher" in code and "c10::Dispatcher" not in code

    # In Inductor's own order the read moves past the write, and the cache is then cloned.
    monkeypatch.setattr(compiled, "INDUCTOR_CONFIG", {})
    _, code = _compiled_code(tmp_path / "reordered", _inputs(ring.clone()))
    assert _largest_buffer(code) >= ring.numel()
