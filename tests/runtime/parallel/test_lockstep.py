"""The lockstep pieces in one process: step messages are plain data, a worker runs only the
operations of its table, a leader session records every change it makes and sends them before
the next replay, and a hit another rank could not use is forgotten (test_parallel_serving and
test_serve_ranks run them across real ranks)."""

from __future__ import annotations

import time

import pytest
import torch

from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.parallel.control import FRAME, ControlChannel, RankLost, decode, encode
from b12x_toolchain.runtime.parallel.lockstep import Follower, LeaderSession, follow
from b12x_toolchain.runtime.prefix.cache import PrefixCache
from b12x_toolchain.runtime.session.validate import OnDevice
from ranks import on_ranks

pytestmark = pytest.mark.slow(minutes=0.4)  # two pairs of rank processes


class Channel:
    """Messages in a list instead of a group: what a leader sent, what a follower receives."""

    rank, world_size, limit_s = 1, 2, 5.0

    def __init__(self, inbox=()):
        self.sent, self.inbox = [], list(inbox)

    def send(self, ops):
        self.sent.append(decode(encode(ops)))

    def receive(self):
        return self.inbox.pop(0)


def test_a_message_is_plain_data_and_tensors_travel_as_their_values():
    ops = [["replay", "verify", {"token_ids": OnDevice(torch.tensor([[1, 2]], dtype=torch.int32)),
                                 "slot_ids": torch.tensor([0]), "positions": [3]}]]
    assert decode(encode(ops)) == [["replay", "verify", {"token_ids": [[1, 2]], "slot_ids": [0], "positions": [3]}]]
    with pytest.raises(TypeError, match="plain data and tensors, not object"):
        encode([["replay", object()]])


def test_a_worker_refuses_an_operation_outside_its_table():
    follower = Follower(session=None, channel=Channel([[["os.system", "true"]]]))
    with pytest.raises(ValueError, match=r"unknown operation 'os.system'; expected one of \[.*'replay'"):
        follow(follower)


def test_a_leader_sends_its_changes_before_the_replay_and_a_follower_makes_them(small_path):
    package = load(small_path)
    channel = Channel()
    leader = LeaderSession(package.session(slots=2), channel)
    leader.reset_slot(1)
    leader.pages.reserve(1, 0, 8)
    width = package.passes["prefill"].width
    leader.replay("prefill", token_ids=[[5, 6, 7] + [0] * (width - 3)], slot_ids=[1], positions=[0], new_tokens=[3])
    assert [op[0] for op in channel.sent[0]] == ["reset_slot", "reserve", "replay"]

    follower = Follower(package.session(slots=2), Channel([channel.sent[0], [["stop"]]]))
    follow(follower)
    assert follower.session.seq_lens[1] == 3
    for name, cache in follower.session.caches.items():
        assert torch.equal(cache, leader.local.caches[name]), name  # the same bytes, by the same replay
    leader.retire_slot(1)
    assert leader.control_messages == 1 and len(channel.sent) == 1  # a change waits for the next message
    leader.stop()
    assert channel.sent[-1] == [["stop"]]  # what was pending matters no more


def test_a_hit_another_rank_could_not_use_counts_as_a_miss_and_leaves_l1(small_path):
    package = load(small_path)
    session = package.session(slots=1)
    cache = PrefixCache(package)
    prompt = list(range(1, package.passes["prefill"].width + 1))
    session.reset_slot(0)
    session.replay("prefill", token_ids=[prompt], slot_ids=[0], positions=[0], new_tokens=[len(prompt)])
    cache.store(session, 0, prompt)
    hit = cache.restore(session, 0, prompt + [20])
    assert hit is not None and cache.stats.prefix_hits == 1
    cache.forget(hit)
    stats = cache.stats
    assert (stats.prefix_hits, stats.misses, stats.hydrate_errors, stats.prefill_tokens_saved) == (0, 1, 1, 0)
    assert cache.restore(session, 0, prompt + [20]) is None  # not chosen again


def _relay(rank, ops):
    channel = ControlChannel(deadline_s=30, join_timeout_s=30)
    if rank == 0:
        channel.send(ops)
        return None
    return channel.receive()


def test_a_message_longer_than_one_frame_arrives_whole():
    long_prompt = list(range(FRAME))  # several frames of digits
    ops = [["snapshot_load", 0, 1, long_prompt], ["agree"]]
    assert on_ranks(_relay, 2, ops)[1] == ops


def _late(rank):
    channel = ControlChannel(deadline_s=30, join_timeout_s=30)
    channel.agree(True)  # both up: the step deadline applies from here
    channel.deadline_s = 2.0
    channel.started()
    if rank == 1:
        time.sleep(6)  # alive but not answering, past the deadline
        return None
    started = time.monotonic()
    with pytest.raises(RankLost) as lost:
        channel.agree(True)
    return str(lost.value), time.monotonic() - started


def test_a_rank_that_does_not_answer_within_the_deadline_is_lost():
    message, waited = on_ranks(_late, 2)[0]
    assert message.startswith("rank 0 of 2: a peer did not answer within 2 s during an agreement")
    assert waited < 2 + 2
