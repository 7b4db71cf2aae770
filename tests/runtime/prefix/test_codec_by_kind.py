"""The snapshot codec knows a cache by its recorded kind, ratio and rows, never by its name.

Every cache of the tiny recipe is renamed to an opaque label, keeping its data: the
layout classifies each the same way, and a capture hydrates another slot byte for byte.
The name regexes the codec used before format 2 match none of the labels, so under
them the codec would have refused every cache (LayoutError).
"""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

import paging
from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.runtime.package.abi import BufferSpec
from b12x_toolchain.runtime.package.contract import BufferInfo, CachePages
from b12x_toolchain.runtime.prefix.snapshot import LayoutError, SnapshotCodec, cache_layout, capabilities
from b12x_toolchain.runtime.session.page_tables import PageTables
from b12x_toolchain.runtime.session.pages import PagePool

OLD_NAMES = (re.compile(r"^cache\.layer(\d+)\.(window|compressed|state|index|index_state)$"),
             re.compile(r"^cache\.draft(\d+)\.(window|hidden)$"), re.compile(r"^cache\.seq_len$"))
LENGTH = 301  # the window ring has wrapped, a ratio-2 group is open


@pytest.fixture(scope="module")
def specs(tiny_recipe):
    d = Dims.from_recipe(tiny_recipe)
    return PASSES["prefill"](d).caches(), d.max_seq_len


def _renamed(specs):
    return [dataclasses.replace(spec, name=f"buffer{i:02d}") for i, spec in enumerate(specs)]


def test_layout_follows_the_data_under_other_names(specs):
    caches, max_seq_len = specs
    renamed = _renamed(caches)
    assert not any(p.match(s.name) for s in renamed for p in OLD_NAMES)  # the old codec knew none of them
    before, after = cache_layout(caches, max_seq_len), cache_layout(renamed, max_seq_len)
    by_label = {old.name: new.name for old, new in zip(caches, renamed)}
    assert {by_label[n]: dataclasses.replace(k, name=by_label[n]) for n, k in before.items()} == after
    assert capabilities(renamed, max_seq_len)["supports_prefix_snapshot"]


def test_a_cache_without_a_known_kind_turns_snapshots_off(specs):
    caches, max_seq_len = specs
    # Named exactly like a window ring, but recorded as nothing the codec knows: the name does not help.
    unknown = BufferSpec("cache.layer0.window", "cache", "uint8", ("slots", 128, 66))
    with pytest.raises(LayoutError, match=r"cache\.layer0\.window: the snapshot codec does not know cache kind None"):
        cache_layout([unknown, *caches[1:]], max_seq_len)
    # A paged entry cache whose block table cannot cover max_seq_len.
    entries = next(s for s in caches if s.info.kind == "compressed_entries")
    short = dataclasses.replace(entries, info=dataclasses.replace(
        entries.info, page=dataclasses.replace(entries.info.page, pages_per_slot=1)))
    assert not capabilities([short if s is entries else s for s in caches], max_seq_len)["supports_prefix_snapshot"]


def _fake(specs, max_seq_len):
    """A package and a session of two slots (plus scratch) holding random bytes, pages included:
    all the codec touches. Slot 0 holds pages for LENGTH tokens."""
    manifest = SimpleNamespace(model=SimpleNamespace(max_seq_len=max_seq_len), format_version="3.0", opset_version=3,
                               recipe={}, recipe_sha256="0" * 64, files={}, weights=SimpleNamespace(file=None))
    package = SimpleNamespace(manifest=manifest, passes={"ingest": SimpleNamespace(inputs=specs)},
                              caches=[s for s in specs if s.role == "cache"])
    gen = torch.Generator().manual_seed(0)
    caches = {s.name: torch.randint(0, 256, s.resolve(paging.symbols(specs, 3)), generator=gen, dtype=torch.uint8)
              if s.dtype == "uint8" else torch.zeros(3, dtype=torch.int32) for s in specs}
    paged = {}
    for s in specs:
        if isinstance(s.info.page, CachePages):
            paged.setdefault(s.info.page.pool, []).append(s)
    pools = {pool: PagePool(pool, caches[group[0].name].shape[0], group[0].info.page.tokens_per_page,
                            group[0].info.page.pages_per_slot, sum(g.info.page.page_bytes for g in group))
             for pool, group in paged.items()}
    tables = PageTables(pools, {pool: {g.name: caches[g.name] for g in group} for pool, group in paged.items()}, 2, "cpu")
    tables.grow([(0, 0, LENGTH)])
    session = SimpleNamespace(package=package, slots=2, caches=caches, seq_lens=[0, 0, 0], pages=tables, device="cpu")
    seq_len = next(s.name for s in specs if s.info == BufferInfo("seq_len"))

    def set_committed_length(slot, length):  # as Session's: the cache and its host mirror
        caches[seq_len][slot] = length
        session.seq_lens[slot] = length

    session.set_committed_length = set_committed_length
    session.reset_slot = lambda slot: (set_committed_length(slot, 0), tables.release_slot(slot))
    return package, session


def test_capture_and_hydrate_under_other_names(specs):
    renamed = _renamed(specs[0])
    package, session = _fake(renamed, specs[1])
    length_name = next(s.name for s in renamed if s.info == BufferInfo("seq_len"))
    session.caches[length_name][0], session.seq_lens[0] = LENGTH, LENGTH
    codec = SnapshotCodec(package)
    snap = codec.capture(session, 0, list(range(LENGTH)))
    codec.hydrate(session, 1, snap)
    assert session.seq_lens[1] == LENGTH and int(session.caches[length_name][1]) == LENGTH
    for name, kind in codec.layout.items():
        rows = kind.rows(LENGTH)
        if kind.kind == "ring":
            assert rows > 0 and torch.equal(session.caches[name][1, :rows], session.caches[name][0, :rows]), name
            continue
        live = [session.caches[name][session.pages.held[kind.pool][slot]].view(-1, kind.row_bytes)[:rows]
                for slot in (0, 1)]
        assert session.pages.held[kind.pool][1] != session.pages.held[kind.pool][0]  # copied into other pages
        assert rows > 0 and torch.equal(live[0], live[1]), name
    rings = {k.capacity for k in codec.layout.values() if k.window}
    assert codec.wrapped(LENGTH) and rings == {128}
