"""Sessions on a CUDA device: captured graphs, byte equality, allocation, graph nodes.

Every test here needs a GPU and is skipped without one; `benchmarks/gpu_check.py` runs
the same checks (and timing) as one qualification command.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.kernel_cases import window_case
from conftest import poison, random_tokens

pytestmark = pytest.mark.cuda


def _prefilled(pkg, slots=4):
    from b12x_toolchain.runtime.serving.speculative import Decoder

    session = pkg.session(device="cuda", slots=slots, max_rows=4)
    gen = torch.Generator().manual_seed(7)
    for slot, length in enumerate((200, 37, 129, 1)[:slots]):
        Decoder(session).prefill(slot, random_tokens(gen, length))
    return session


def test_dispatch_reaches_the_cuda_kernels_and_matches_the_cpu_bytes():
    from b12x_toolchain.runtime.ops import opset as ops

    assert ops.CUDA_KERNELS
    case = window_case(torch.Generator().manual_seed(0), 3, 8, 512, 64)
    want = case["staging"].clone()
    torch.ops.b12x_toolchain.window_snapshot_append(case["ring"], want, case["kv"], case["row_ids"], case["positions"],
                                          128, "NHD", 64, "dsv41_mxfp8")
    g = {k: v.cuda() for k, v in case.items()}
    torch.ops.b12x_toolchain.window_snapshot_append(g["ring"], g["staging"], g["kv"], g["row_ids"], g["positions"],
                                          128, "NHD", 64, "dsv41_mxfp8")
    assert torch.equal(g["staging"].cpu(), want)


def test_every_bucket_is_captured_and_warm_up_touches_only_the_scratch_slot(fused_pkg):
    gen = torch.Generator().manual_seed(1)
    caches = {}
    probe = fused_pkg.session(device="cpu", slots=2, max_rows=4)
    for name, cache in probe.caches.items():
        filled = torch.randint(0, 100, cache.shape, generator=gen).to(cache.dtype) if name != "cache.seq_len" \
            else torch.zeros_like(cache)
        caches[name] = filled.cuda()
    before = {k: v.clone() for k, v in caches.items()}
    session = fused_pkg.session(device="cuda", slots=2, max_rows=4, buffers=caches)
    for pass_name, buckets in session.buckets.items():
        for rows in buckets:
            assert session.graphs.graph(pass_name, rows) is not None
    for name, cache in caches.items():
        assert torch.equal(cache[:2], before[name][:2]), f"warm-up changed a request slot of {name}"


@pytest.mark.parametrize("rows", [1, 3])
def test_fused_and_unfused_write_identical_bytes_on_cuda(fused_pkg, unfused_pkg, rows):
    sessions = [_prefilled(fused_pkg), _prefilled(unfused_pkg)]
    gen = torch.Generator().manual_seed(100 + rows)
    slots = [1] if rows == 1 else [3, 0, 2]
    for step in range(2):
        positions = [sessions[0].seq_lens[s] for s in slots]
        draft, verify = [random_tokens(gen, 7) for _ in slots], [random_tokens(gen, 8) for _ in slots]
        accept = [8] + [3] * (rows - 1)
        seen = []
        for session in sessions:
            poison(session)
            d = session.replay("draft", token_ids=draft, slot_ids=slots, positions=positions)["logits"].clone()
            poison(session)
            v = session.replay("verify", token_ids=verify, slot_ids=slots, positions=positions)["logits"].clone()
            staging = {k: t.clone() for k, t in session.staging.items()}
            session.replay("commit", slot_ids=slots, positions=positions, accepted_tokens=accept)
            seen.append((d, v, staging))
        assert torch.equal(seen[0][0], seen[1][0]) and torch.equal(seen[0][1], seen[1][1])
        for name in seen[0][2]:
            if name.startswith("staging.verify."):  # draft staging is poisoned again before verify
                assert torch.equal(seen[0][2][name], seen[1][2][name]), name
        for name, cache in sessions[0].caches.items():
            assert torch.equal(cache, sessions[1].caches[name]), name


def test_replays_allocate_nothing(fused_pkg):
    session = _prefilled(fused_pkg)
    slots = [3, 0, 2]
    positions = [session.seq_lens[s] for s in slots]
    tokens = [random_tokens(torch.Generator().manual_seed(2), 8) for _ in slots]
    session.replay("verify", token_ids=tokens, slot_ids=slots, positions=positions)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(100):
        session.replay("verify", token_ids=tokens, slot_ids=slots, positions=positions)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_fused_graphs_have_one_kernel_node_fewer_per_fused_layer(fused_pkg, unfused_pkg):
    from benchmarks.gpu_check import node_types

    fused, unfused = _prefilled(fused_pkg, 1), _prefilled(unfused_pkg, 1)
    results = fused_pkg.manifest.rewrites.results
    for pass_name in ("verify", "draft", "commit", "prefill"):
        matches = results[pass_name]["fuse_window_snapshot"]["matches"]
        for rows in fused.buckets[pass_name]:
            f = node_types(fused.graphs.graph(pass_name, rows))
            u = node_types(unfused.graphs.graph(pass_name, rows))
            assert u[0] - f[0] == matches, (pass_name, rows, u, f)
