"""The graph runner's bookkeeping, on CPU tensors: bucket choice, address checks, refusal.

On the CPU nothing is captured, but the runner keeps the same records and makes the same
checks as on CUDA, where a rebound buffer would otherwise be written through a stale
address without any error.
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.serving.speculative import Decoder
from b12x_toolchain.runtime.session.graph_runner import ForeignBufferError, GraphRunner
from conftest import random_tokens


class FakeBucket:
    """What the runner needs of a bucket: rows, static inputs and outputs, and run()."""

    def __init__(self, rows, cache):
        self.rows, self.cache, self.runs = rows, cache, 0
        self.inputs = {"row_ids": torch.zeros(rows, dtype=torch.int32)}
        self.padding = {"row_ids": 9}  # the scratch slot
        self.outputs = {"out": torch.zeros(rows)}

    def run(self):
        self.runs += 1
        self.cache += 1  # the "graph" writes the cache it was built with
        return {"out": self.cache[: self.rows].float()}


def _runner(caches, staging=None):
    runner = GraphRunner("cpu", (caches, staging or {}))
    buckets = {rows: FakeBucket(rows, caches["c"]) for rows in (1, 2, 4)}
    for bucket in buckets.values():
        runner.add("verify", bucket)
    return runner, buckets


def test_smallest_bucket_that_holds_the_rows():
    runner, buckets = _runner({"c": torch.zeros(8, dtype=torch.int32)})
    assert [runner.bucket_for("verify", n).rows for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match="5 rows exceed the largest prepared bucket 4"):
        runner.bucket_for("verify", 5)
    with pytest.raises(ValueError, match="no prepared buckets"):
        runner.bucket_for("draft", 1)


def test_cpu_replay_runs_the_step_and_fills_static_outputs():
    caches = {"c": torch.zeros(8, dtype=torch.int32)}
    runner, buckets = _runner(caches)
    assert runner.captures is False and runner.graph("verify", 2) is None
    runner.replay("verify", buckets[2])
    assert buckets[2].runs == 1 and buckets[2].outputs["out"].tolist() == [1.0, 1.0]  # no warm-up ran


def test_a_rebound_buffer_is_refused_before_anything_runs():
    caches, staging = {"c": torch.zeros(8, dtype=torch.int32)}, {"s": torch.zeros(3)}
    runner, buckets = _runner(caches, staging)
    original = caches["c"]
    caches["c"] = torch.zeros(8, dtype=torch.int32)  # a foreign buffer under the same name
    with pytest.raises(ForeignBufferError, match=r"^c: bound at 0x[0-9a-f]+ when the session was prepared, now 0x"):
        runner.replay("verify", buckets[1])
    assert buckets[1].runs == 0 and original.sum() == 0 and caches["c"].sum() == 0
    caches["c"] = original  # rebinding the original makes the session usable again
    runner.replay("verify", buckets[1])
    staging["s"] = torch.zeros(3)
    with pytest.raises(ForeignBufferError, match="^s: bound at"):
        runner.replay("verify", buckets[1])


def test_added_or_removed_buffers_are_refused():
    caches = {"c": torch.zeros(8, dtype=torch.int32)}
    runner, buckets = _runner(caches)
    caches["extra"] = torch.zeros(1)
    with pytest.raises(ForeignBufferError, match=r"added \['extra'\], removed \[\]"):
        runner.replay("verify", buckets[1])


def test_in_place_writes_keep_the_buffers_valid():
    caches = {"c": torch.zeros(8, dtype=torch.int32)}
    runner, buckets = _runner(caches)
    caches["c"].fill_(-1)  # poisoning in place is allowed: same memory
    runner.check_buffers()
    runner.replay("verify", buckets[4])
    assert buckets[4].runs == 1


def test_a_bucket_the_runner_did_not_prepare_is_refused():
    caches = {"c": torch.zeros(8, dtype=torch.int32)}
    runner, buckets = _runner(caches)
    with pytest.raises(ValueError, match="not one this runner prepared"):
        runner.replay("verify", FakeBucket(2, caches["c"]))


# ---------------------------------------------------------------- through a session


def test_session_refuses_a_rebound_cache_and_leaves_every_cache_untouched(fused_pkg):
    session = fused_pkg.session(slots=2, max_rows=4)
    Decoder(session).prefill(0, random_tokens(torch.Generator().manual_seed(4), 20))
    before = {k: v.clone() for k, v in session.caches.items()}
    name = "cache.layer0.window"
    original = session.caches[name]
    session.caches[name] = original.clone()
    with pytest.raises(ForeignBufferError, match=f"^{name}: bound at"):
        session.replay("commit", slot_ids=[0], positions=[20], accepted_tokens=[3])
    assert all(torch.equal(session.caches[k], v) for k, v in before.items())
    assert session.seq_lens[0] == 20  # the refused commit did not advance the slot
    session.caches[name] = original
    session.replay("verify", token_ids=[random_tokens(torch.Generator(), 8)], slot_ids=[0], positions=[20])


def test_session_buckets_come_from_its_runner(fused_pkg):
    session = fused_pkg.session(slots=4, max_rows=4)
    for rows, bucket_rows in ((1, 1), (2, 2), (3, 4), (4, 4)):
        bucket = session.bucket_for("verify", rows)
        assert bucket.rows == bucket_rows and session.buckets["verify"][bucket_rows] is bucket
    with pytest.raises(ValueError, match="exceed the largest prepared bucket 4"):
        session.bucket_for("verify", 5)
