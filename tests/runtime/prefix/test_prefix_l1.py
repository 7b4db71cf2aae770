"""L1: longest prefix, exact tokens behind the hash, dominated prefixes dropped, LRU by bytes and entries."""

from __future__ import annotations

import random
import threading

import pytest

from b12x_toolchain.runtime.prefix import keys as prefix_keys
from b12x_toolchain.runtime.prefix.keys import token_bytes
from b12x_toolchain.runtime.prefix.l1 import L1Cache
from runtime.prefix.helpers import fake_identity, is_intact, make_snapshot

IDENT = fake_identity()
BASE = list(range(100, 140))


def lookup(l1, tokens, ident=IDENT):
    return l1.lookup(ident.key, token_bytes(tokens))


def test_longest_stored_prefix_wins():
    l1 = L1Cache(1 << 20)
    short = make_snapshot(IDENT, BASE[:4])
    branch = make_snapshot(IDENT, BASE[:3] + [9] + BASE[4:10])  # diverges at token 3: dominates nothing
    other = make_snapshot(IDENT, [1, 2, 3, 4, 5, 6])
    for snap in (short, branch, other):
        assert l1.insert(snap)
    assert lookup(l1, BASE) is short
    assert lookup(l1, branch.token_ids + [5, 5]) is branch
    assert lookup(l1, branch.token_ids) is branch  # the whole prompt: an exact hit
    assert lookup(l1, BASE[:3]) is None  # no stored snapshot fits inside 3 tokens
    assert lookup(l1, [1, 2, 3, 4, 5, 6, 7]) is other
    assert lookup(l1, BASE, fake_identity("b")) is None  # same tokens, another package
    s = l1.stats
    assert (s.lookups, s.hits, s.misses) == (6, 4, 2)


def test_a_refused_candidate_falls_back_to_a_shorter_prefix():
    l1 = L1Cache(1 << 20)
    l1.insert(make_snapshot(IDENT, BASE[:4]))
    assert l1.lookup(IDENT.key, token_bytes(BASE), lambda s: s.length < 4) is None
    l1.insert(make_snapshot(IDENT, BASE[:2]))  # shorter than what is stored: it dominates nothing
    assert l1.lookup(IDENT.key, token_bytes(BASE), lambda s: s.length < 4).length == 2
    assert l1.lookup(IDENT.key, token_bytes(BASE)).length == 4


def test_storing_a_longer_prefix_drops_the_ones_it_dominates():
    l1 = L1Cache(1 << 20)
    l1.insert(make_snapshot(IDENT, BASE[:4]))
    l1.insert(make_snapshot(IDENT, BASE[:8]))
    branch = make_snapshot(IDENT, BASE[:6] + [1])
    l1.insert(branch)
    l1.insert(make_snapshot(fake_identity("b"), BASE[:4]))  # another package's prefix is not dominated
    l1.insert(make_snapshot(IDENT, BASE[:20]))
    lengths = sorted((s.identity.key == IDENT.key, s.length) for s in l1.snapshots())
    assert lengths == [(False, 4), (True, 7), (True, 20)]
    assert l1.stats.prefix_prunes == 2
    assert lookup(l1, branch.token_ids) is branch


def test_lru_by_entries_and_a_hit_refreshes():
    l1 = L1Cache(1 << 20, max_entries=3)
    snaps = [make_snapshot(IDENT, [i] * 5) for i in range(4)]
    for snap in snaps[:3]:
        l1.insert(snap)
    assert lookup(l1, [0] * 5) is snaps[0]  # 0 is now the most recent
    l1.insert(snaps[3])
    assert [s.token_ids[0] for s in l1.snapshots()] == [2, 0, 3]
    assert l1.stats.evictions == 1 and len(l1) == 3


def test_lru_by_bytes_and_an_entry_larger_than_the_budget():
    one = make_snapshot(IDENT, [0] * 8).nbytes
    l1 = L1Cache(3 * one + one // 2, max_entries=100)
    snaps = [make_snapshot(IDENT, [i] * 8) for i in range(5)]
    for snap in snaps[:3]:
        l1.insert(snap)
    lookup(l1, [1] * 8)
    l1.insert(snaps[3])
    assert [s.token_ids[0] for s in l1.snapshots()] == [2, 1, 3]
    assert l1.nbytes == sum(s.nbytes for s in l1.snapshots()) <= l1.max_bytes
    huge = make_snapshot(IDENT, [9] * 8, row_bytes=4096)
    assert not l1.insert(huge)
    assert l1.stats.too_large == 1 and len(l1) == 3  # nothing was evicted for it


def test_a_forced_hash_collision_never_returns_a_wrong_prefix(monkeypatch):
    class Constant:
        def __init__(self, *args):
            pass

        def update(self, data):
            pass

        def copy(self):
            return self

        def hexdigest(self):
            return "0" * 64

    monkeypatch.setattr(prefix_keys, "_hasher", Constant)
    l1 = L1Cache(1 << 20)
    x, y = make_snapshot(IDENT, [1, 2, 3, 4, 5]), make_snapshot(IDENT, [1, 2, 3, 4, 6])
    l1.insert(x)
    assert lookup(l1, [1, 2, 3, 4, 6, 7]) is None
    assert l1.stats.hash_collisions >= 1
    l1.insert(y)  # same length and hash, other tokens: both are kept
    assert lookup(l1, [1, 2, 3, 4, 6, 7]) is y and lookup(l1, [1, 2, 3, 4, 5]) is x
    assert len(l1) == 2


def test_an_entry_evicted_while_in_use_stays_whole():
    l1 = L1Cache(1 << 20, max_entries=2)
    l1.insert(make_snapshot(IDENT, BASE[:10]))
    held = lookup(l1, BASE)
    for i in range(5):
        l1.insert(make_snapshot(IDENT, [i] * 10))
    assert lookup(l1, BASE) is None and is_intact(held)


def test_threads_lose_nothing_and_corrupt_nothing():
    prompts = [[p] * 3 + [random.Random(p).randrange(512) for _ in range(9)] for p in range(24)]
    pool = {p: [make_snapshot(IDENT, t[:n]) for n in (4, 8, 12)] for p, t in enumerate(prompts)}
    one = pool[0][2].nbytes
    l1 = L1Cache(10 * one, max_entries=12)
    bad, hits = [], [0]
    lock = threading.Lock()

    def work(seed):
        rng = random.Random(seed)
        for _ in range(300):
            p = rng.randrange(len(prompts))
            if rng.random() < 0.5:
                l1.insert(pool[p][rng.randrange(3)])
            else:
                snap = lookup(l1, prompts[p])
                if snap is not None:
                    with lock:
                        hits[0] += 1
                    if not is_intact(snap) or snap.tokens != token_bytes(prompts[p][: snap.length]):
                        bad.append(snap)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = l1.stats
    assert bad == [] and hits[0] > 0
    assert s.hits + s.misses == s.lookups == hits[0] + s.misses
    assert l1.nbytes == sum(x.nbytes for x in l1.snapshots()) <= l1.max_bytes and len(l1) <= 12
    assert s.insertions - s.evictions - s.prefix_prunes == len(l1)


def test_budget_arguments_are_checked():
    with pytest.raises(ValueError):
        L1Cache(-1)
    with pytest.raises(ValueError):
        L1Cache(10, max_entries=0)
