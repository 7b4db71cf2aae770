"""A session drives passes by their recorded data, not their names.

The small package's passes are renamed (prefill -> ingest, commit -> persist, ...):
the session still advances committed lengths by each pass's `advances` input, bounds
its counts by the input's kind, and pads rows through the slot_ids input. Before format
2 the session looked for passes called "prefill" and "commit", so under the new names
no length would have moved and the second replay's positions would have been refused.
"""

from __future__ import annotations

import dataclasses

import pytest

from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.package.reader import Package
from b12x_toolchain.runtime.session.validate import InputError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NAMES = {"prefill": "ingest", "verify": "check", "draft": "guess", "commit": "persist", "decode": "step"}


@pytest.fixture(scope="module")
def renamed(small_path):
    package = load(small_path)
    passes = {}
    for old, info in package.passes.items():
        source = NAMES.get(info.reads_staging_of) if info.reads_staging_of else None
        passes[NAMES[old]] = dataclasses.replace(info, name=NAMES[old], reads_staging_of=source)
    return Package(package.path, package.manifest, passes, package.weights)


def test_lengths_advance_by_the_recorded_input(renamed):
    session = renamed.session(slots=2, max_rows=2)
    chunk = renamed.passes["ingest"].width
    session.replay("ingest", token_ids=[[3] * chunk], slot_ids=[1], positions=[0], new_tokens=[5])
    assert session.seq_lens[:2] == [0, 5] and int(session.caches[session.seq_len_buffer][1]) == 5
    session.replay("check", token_ids=[[4] * 8], slot_ids=[1], positions=[5])
    assert session.seq_lens[1] == 5  # staging only: advances is null
    session.replay("persist", slot_ids=[1], positions=[5], accepted_tokens=[3])
    assert session.seq_lens[1] == 8 and int(session.caches[session.seq_len_buffer][1]) == 8
    session.replay("persist", slot_ids=[1], positions=[8], accepted_tokens=[0])  # accepted_tokens: 0 is a count
    assert session.seq_lens[1] == 8
    with pytest.raises(InputError, match=r"new_tokens: value 0 is out of range; expected a row count .* \[1, "):
        session.replay("ingest", token_ids=[[3] * chunk], slot_ids=[1], positions=[8], new_tokens=[0])  # new_tokens: 1 at least
    session.reset_slot(1)
    assert session.seq_lens[1] == 0 and int(session.caches[session.seq_len_buffer][1]) == 0


def test_padding_rows_point_at_the_scratch_slot(renamed):
    session = renamed.session(slots=3, max_rows=4)
    session.replay("check", token_ids=[[1] * 8] * 3, slot_ids=[0, 1, 2], positions=[0, 0, 0])  # bucket 4: one padding row
    bucket, slots = session.bucket_for("check", 3), renamed.passes["check"].input_of("slot_ids")
    assert bucket.padding[slots] == session.scratch_slot
    assert bucket.inputs[slots].tolist() == [0, 1, 2, session.scratch_slot]
