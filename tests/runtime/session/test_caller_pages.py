"""Caller-owned pages: a server passes its own block tables; where the pages lie changes nothing.

The session's own allocator hands slot 0 the lowest pages in order; here the caller maps
the same tokens to pages in reverse, from the top of the pool, and must get the same
logits bit for bit. Block tables that point outside the pool, or miss a page a pass reads
or writes, are refused before anything runs.
"""

from __future__ import annotations

import pytest
import torch

from b12x_toolchain.runtime.session.validate import InputError

PAGES = 16


def tables(session, pages_by_pool: dict) -> dict:
    info = session.package.passes["prefill"]
    out = {}
    for pool, name in info.block_tables.items():
        width = session.pools[pool].pages_per_slot
        ids = pages_by_pool[pool]
        out[info.input_kinds[name]] = torch.tensor([ids + [-1] * (width - len(ids))], dtype=torch.int32)
    return out


def run(session, block_tables: dict | None) -> list[torch.Tensor]:
    extra = block_tables or {}
    prompt = list(range(3, 67))
    first = session.replay("prefill", token_ids=[prompt], slot_ids=[0], positions=[0], new_tokens=[64], **extra)
    logits = [first["logits"].clone()]
    second = session.replay("prefill", token_ids=[list(range(9, 73))], slot_ids=[0], positions=[64], new_tokens=[40], **extra)
    logits.append(second["logits"].clone())
    verify = session.replay("verify", token_ids=[[5] * 8], slot_ids=[0], positions=[104], **extra)
    return logits + [verify["logits"].clone()]


def test_caller_block_tables_in_any_page_order_give_the_same_logits(fused_pkg):
    own = run(fused_pkg.session(slots=2, pages=PAGES), None)
    session = fused_pkg.session(slots=2, pages=PAGES)
    # 104 tokens: 2 entry pages of 64 tokens, 4 index-key pages of 32, from the top of the pool down.
    reversed_pages = {pool: [PAGES - 1 - i for i in range(pool_info.pages_for(104))]
                      for pool, pool_info in session.pools.items()}
    session.poison_free_pages()
    theirs = run(session, tables(session, reversed_pages))
    assert all(torch.equal(a, b) for a, b in zip(own, theirs))


def test_bad_block_tables_are_refused_before_anything_runs(fused_pkg):
    session = fused_pkg.session(slots=2, pages=PAGES)
    before = {n: t.clone() for n, t in session.caches.items()}
    good = {pool: [0, 1, 2, 3] for pool in session.pools}
    prefill = dict(token_ids=[[1] * 64], slot_ids=[0], positions=[0], new_tokens=[64])
    bad = tables(session, {**good, "entry_pages": [99]})
    with pytest.raises(InputError, match=r"entry_block_table: value 99 is out of range; expected a page id of pool "
                                         r"entry_pages \(or -1\) in \[-1, 16\)"):
        session.replay("prefill", **prefill, **bad)
    short = tables(session, {**good, "index_key_pages": [0]})  # 64 tokens need two 32-token pages
    with pytest.raises(InputError, match=r"index_key_block_table: row 0 has no page at column 1; the pass reads or "
                                         r"writes its tokens up to 64 \(32 per page\)"):
        session.replay("prefill", **prefill, **short)
    one = {k: v for k, v in tables(session, good).items() if k == "entry_block_table"}
    with pytest.raises(InputError, match=r"block tables \['entry_block_table'\] given without "
                                         r"\['index_key_block_table'\]"):
        session.replay("prefill", **prefill, **one)
    assert all(torch.equal(before[n], t) for n, t in session.caches.items())
