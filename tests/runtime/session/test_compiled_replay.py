"""Compiled replay (Inductor) gives the uncompiled replay's results: logits to fp32 rounding, commit to
the byte; and among compiled passes, decode gives verify's first row and its committed caches to the bit."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.ops.namespace import NAMESPACE
from b12x_toolchain.runtime.ops.opset import OPS
from b12x_toolchain.runtime.session.code_string_arguments import TWIN_NAMESPACE, coded_arguments
from b12x_toolchain.runtime.session.compiled import CompiledGraph
from conftest import random_tokens

pytestmark = pytest.mark.slow(minutes=1.0)

# Verify stages rows (the fused window snapshot among them), decode writes the caches it reads, and
# commit writes the caches from the staging; test_inductor_writes holds a compiled read-then-write of a
# window ring to writing in place.
COMPILED = ("verify", "decode", "commit")
CODED = {name for name, op in OPS.items() if coded_arguments(op)}


@pytest.fixture(scope="module")
def sessions(one_layer_path, tmp_path_factory):
    package = load(one_layer_path)  # half the graph Inductor compiles for SMALL
    cache = tmp_path_factory.mktemp("compile-cache")
    plain = package.session(slots=1, max_rows=1)
    # Compiled as servers compile: in the background, by a child process, then loaded from the cache
    # and switched in all at once (background_compile.py, compile_worker.py). The child runs at the
    # lowest priority: on a machine busy with other work it waits its turn (the generous bound).
    compiled = package.session(slots=1, max_rows=1, compile=COMPILED, compile_cache=cache, compile_in_background=True)
    assert compiled.compiler.wait(1800) and compiled.compiler.status()["error"] is None
    assert compiled.swap_in_compiled()
    return package, plain, compiled, cache


def ops_called(profile) -> set[str]:
    """The op set's ops a profiled replay ran, by name. On the CPU each op with a string or int-list
    argument runs as its coded twin, which takes those as integers (code_string_arguments.py)."""
    keys = [e.key.split("::") for e in profile.key_averages()]
    assert [k for k in keys if k[0] == NAMESPACE and k[1] in CODED] == [], "a call the C++ wrapper boxes"
    return {k[1] for k in keys if k[0] in (NAMESPACE, TWIN_NAMESPACE)}


def _copy_state(source, target):
    for name in source.caches:
        target.caches[name].copy_(source.caches[name])
    for name in source.staging:
        target.staging[name].copy_(source.staging[name])
    target.seq_lens[:] = source.seq_lens


def test_compiled_passes_agree_with_the_uncompiled_replay(sessions):
    package, plain, compiled, cache = sessions
    gen = torch.Generator().manual_seed(3)
    prompt, block = random_tokens(gen, package.passes["prefill"].width), random_tokens(gen, 8)
    plain.replay("prefill", token_ids=[prompt], slot_ids=[0], positions=[0], new_tokens=[len(prompt)])

    # From the same caches (the plain session's), verify agrees to fp32 rounding ...
    _copy_state(plain, compiled)
    step = {"token_ids": [block], "slot_ids": [0], "positions": [len(prompt)]}
    want = plain.replay("verify", **step)["logits"].clone()
    compiled.replay("verify", **step)  # verify writes only staging, so it can run again
    with torch.profiler.profile() as profile:
        got = compiled.replay("verify", **step)["logits"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    called = ops_called(profile)
    # The ops that select by data run as themselves; Inductor took the pure ones as their references.
    assert {"indexer_topk", "window_snapshot_append"} <= called
    assert not called & {"hc_sinkhorn", "window_read", "read_rows"}
    assert "sparse_attention" in called  # kept: its sums over keys run in a fixed order

    # Compiled, a token's logits do not depend on the pass either: decode = verify's first row.
    decoded = compiled.replay("decode", token_ids=[block[:1]], slot_ids=[0], positions=[len(prompt)],
                              new_tokens=[1])["logits"]
    assert torch.equal(decoded.flatten(), got[0, 0].flatten())
    # ... and its caches: decode's own writes = verify's staged rows committed for that one token.
    decoded_caches = {name: values.clone() for name, values in compiled.caches.items()}
    _copy_state(plain, compiled)
    compiled.replay("verify", **step)
    compiled.replay("commit", slot_ids=[0], positions=[len(prompt)], accepted_tokens=[1])
    for name, values in compiled.caches.items():
        assert torch.equal(values, decoded_caches[name]), name

    # ... and commit, which only moves bytes, writes exactly the same caches.
    _copy_state(plain, compiled)
    accept = {"slot_ids": [0], "positions": [len(prompt)], "accepted_tokens": [5]}
    with torch.profiler.profile() as profile:
        got = compiled.replay("commit", **accept)["next_positions"].tolist()
    assert got == plain.replay("commit", **accept)["next_positions"].tolist()
    assert "write_rows" in ops_called(profile)  # writes in place, as itself
    for name in plain.caches:
        assert torch.equal(compiled.caches[name], plain.caches[name]), name

    ran = [b.graph for p in COMPILED for b in compiled.buckets[p].values()]
    assert all(isinstance(g, CompiledGraph) and g.compiled for g in ran)  # the compiled code really ran
    assert not any(isinstance(b.graph, CompiledGraph) for p in ("prefill", "draft")
                   for b in compiled.buckets[p].values())
    # Inductor's artifacts are under the session's own directory: package digest, device, torch.
    digest = package.manifest.manifest_sha256[:32]
    assert compiled.compile_cache.parent == cache / digest
    assert compiled.compile_cache.name == f"cpu-torch{torch.__version__.replace('+', '_')}"
    assert any(compiled.compile_cache.rglob("*")), "nothing was cached"


def test_a_later_session_reads_every_graph_back_from_the_cache(sessions):
    package, plain, compiled, cache = sessions
    hits = counters["aot_autograd"]["autograd_cache_hit"]
    warm = package.session(slots=1, max_rows=1, compile=COMPILED, compile_cache=cache, compile_in_background=True)
    assert warm.compiler.status()["state"] == "compiled"  # loaded as it opened: compiled from its first replay
    assert counters["aot_autograd"]["autograd_cache_hit"] - hits == len(COMPILED)  # read back, not traced again
    # Without the background compilation, a pass compiles (here: reads back) on its first replay.
    on_first_use = package.session(slots=1, max_rows=1, compile=COMPILED, compile_cache=cache)
    step = {"token_ids": [[7] * 8], "slot_ids": [0], "positions": [plain.seq_lens[0]]}
    logits = []
    for session in (compiled, warm, on_first_use):
        _copy_state(plain, session)
        logits.append(session.replay("verify", **step)["logits"].clone())
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    assert all(b.graph.compiled for b in on_first_use.buckets["verify"].values())


def test_compile_names_the_passes_it_takes(small_path):
    package = load(small_path)
    with pytest.raises(ValueError, match=r"compile=\('verify', 'sample'\): expected True, False or pass names among "
                                         r"\['commit', 'decode', 'draft', 'prefill', 'verify'\]"):
        package.session(compile=("verify", "sample"))
