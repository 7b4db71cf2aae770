"""Decoder + PrefixCache: hits skip the prefix and change no output; gating and identity make misses."""

from __future__ import annotations

import re

import pytest
import torch
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.prefix.cache import PrefixCache
from b12x_toolchain.runtime.prefix.l2 import L2Store
from b12x_toolchain.runtime.serving.speculative import Decoder
from conftest import random_tokens
from runtime.prefix.conftest import with_capabilities, with_manifest

pytestmark = pytest.mark.slow(minutes=0.3)

CHUNK = 64


@pytest.fixture(scope="module")
def prompt():
    return random_tokens(torch.Generator().manual_seed(31), 300)


def counting(session):
    """Wrap session.replay to count prefill replays."""
    calls = []
    replay = session.replay

    def wrapped(name, **values):
        calls.append(name)
        return replay(name, **values)

    session.replay = wrapped
    return calls


def run(package, prompts, cache=None, new_tokens=6):
    """Prefill each prompt in its own slot and decode greedily; returns tokens, margins and the
    verify logits each slot gives right after its prefill (a bitwise probe of its caches)."""
    session = package.session(slots=len(prompts), max_rows=1)
    decoder = Decoder(session, prefix_cache=cache)
    out = []
    for slot, p in enumerate(prompts):
        row = decoder.prefill(slot, p)
        probe = session.replay("verify", token_ids=[[row.pending] + p[:7]], slot_ids=[slot],
                               positions=[row.length])["logits"].clone()
        for _ in range(new_tokens):
            decoder.step([row], speculative=False)
        out.append((row.tokens, decoder.margins[slot], probe))
    return out


def test_an_exact_hit_replays_nothing_and_gives_the_same_tokens(small_pkg, prompt):
    cold = run(small_pkg, [prompt[:150]])[0]
    cache = PrefixCache(small_pkg)
    session = small_pkg.session(slots=2, max_rows=1)
    decoder = Decoder(session, prefix_cache=cache)
    first = decoder.prefill(0, prompt[:150])
    calls = counting(session)
    second = decoder.prefill(1, prompt[:150])
    assert calls == [] and second.pending == first.pending == cold[0][0]
    assert decoder.margins[1] == decoder.margins[0] == cold[1][:1]
    s = cache.stats_dict()
    assert (s["lookups"], s["exact_hits"], s["misses"], s["prefill_tokens_saved"]) == (2, 1, 1, 150)


@pytest.mark.parametrize("tier", ["l1", "l2"])
def test_a_hit_at_a_chunk_boundary_is_bitwise_a_cold_prefill(small_pkg, prompt, tier, tmp_path):
    """Snapshots every 64 tokens, none at the prompt's end: a longer prompt resumes at 192 and
    replays exactly the chunks a cold prefill replays there."""
    options = {"l1_bytes": 0, "l2_dir": tmp_path, "write_behind": False} if tier == "l2" else {}
    cache = PrefixCache(small_pkg, every=CHUNK, end_of_prompt=False, **options)
    run(small_pkg, [prompt[:200]], cache)
    if tier == "l2":
        assert cache.l2.stats.writes == 3  # 64, 128 and 192
    session = small_pkg.session(slots=1, max_rows=1)
    calls = counting(session)
    Decoder(session, prefix_cache=cache).prefill(0, prompt)
    assert calls.count("prefill") == 2  # 192..255 and 256..299, not five chunks
    hit = run(small_pkg, [prompt], cache)[0]  # resumes at 256, stored by the prefill just above
    cold = run(small_pkg, [prompt])[0]
    assert hit[0] == cold[0] and hit[1] == cold[1] and torch.equal(hit[2], cold[2])
    s = cache.stats_dict()
    assert s["prefix_hits"] == 2 and s["prefill_tokens_saved"] == 192 + 256
    assert s["exact_hits"] + s["prefix_hits"] + s["misses"] == s["lookups"]
    cache.close()


def test_a_hit_at_an_earlier_prompts_end_continues_it(small_pkg, prompt):
    cache = PrefixCache(small_pkg)
    run(small_pkg, [prompt[:170]], cache)
    hit = run(small_pkg, [prompt], cache)[0]
    cold = run(small_pkg, [prompt])[0]
    # Chunks start at 170 instead of 128 and 192: equal to a cold prefill up to float rounding.
    assert torch.allclose(hit[2], cold[2], atol=1e-4, rtol=0)
    assert hit[0] == cold[0] or min(cold[1]) < 1e-4
    assert cache.stats_dict()["prefill_tokens_saved"] == 170
    assert [s.length for s in cache.l1.snapshots()] == [300]  # 170 was dominated by 300


def test_the_stored_snapshot_outlives_the_slot_it_was_hydrated_into(small_pkg, prompt):
    cache = PrefixCache(small_pkg)
    first = run(small_pkg, [prompt[:100], prompt[:100]], cache, new_tokens=20)
    assert first[0][0] == first[1][0] and torch.equal(first[0][2], first[1][2])
    again = run(small_pkg, [prompt[:100]], cache, new_tokens=20)[0]  # after decoding wrote over the slot
    assert again[0] == first[0][0] and torch.equal(again[2], first[0][2])


@pytest.mark.parametrize("flags", [{"prefix_snapshot": False, "rotating_cache_snapshot": False},
                                   {"prefix_snapshot": False, "rotating_cache_snapshot": True},
                                   {"remove": True}])
def test_without_the_capability_lookups_miss_and_output_is_cold(small_pkg, prompt, flags, tmp_path):
    with PrefixCache(small_pkg, l2_dir=tmp_path, write_behind=False) as filler:
        run(small_pkg, [prompt[:150]], filler)  # the directory holds a matching snapshot
    package = with_capabilities(small_pkg, **flags)
    cache = PrefixCache(package, l2_dir=tmp_path)
    assert not cache.enabled and cache.l2 is None and "supports_prefix_snapshot" in cache.reason
    got = run(package, [prompt[:150], prompt[:150]], cache)
    cold = run(small_pkg, [prompt[:150]])[0]
    for tokens, margins, probe in got:
        assert tokens == cold[0] and margins == cold[1] and torch.equal(probe, cold[2])
    s = cache.stats_dict()
    assert (s["lookups"], s["misses"], s["disabled_misses"], s["insertions"]) == (2, 2, 2, 0)


def test_without_rotating_snapshots_only_unwrapped_windows_are_used(small_pkg, prompt, tmp_path):
    with PrefixCache(small_pkg, l2_dir=tmp_path, write_behind=False) as filler:
        run(small_pkg, [prompt[:200]], filler)  # a wrapped (200 > 128) snapshot on disk
    package = with_capabilities(small_pkg, prefix_snapshot=True, rotating_cache_snapshot=False)
    cache = PrefixCache(package, l2_dir=tmp_path, write_behind=False)
    run(package, [prompt[:100], prompt[:250]], cache)
    assert [s.length for s in cache.l1.snapshots()] == [100]  # 250 wraps the window: not stored
    hit = run(package, [prompt[:240]], cache)[0]
    assert cache.stats_dict()["prefill_tokens_saved"] == 100 + 100  # 200 was on disk, and refused
    assert cache.l2.stats.hits == 0
    cold = run(small_pkg, [prompt[:240]])[0]
    assert torch.allclose(hit[2], cold[2], atol=1e-4, rtol=0)
    cache.close()


def test_snapshots_of_other_weights_formats_or_recipes_miss(small_pkg, other_weights_pkg, chat_path, prompt, tmp_path):
    with PrefixCache(small_pkg, l2_dir=tmp_path, write_behind=False) as filler:
        run(small_pkg, [prompt[:150]], filler)
    other_recipe = with_manifest(small_pkg, recipe_sha256="0" * 64)
    assert other_weights_pkg.manifest.recipe_sha256 == small_pkg.manifest.recipe_sha256
    # The small model with float32 caches (and the shipped tokenizer's vocabulary): other formats.
    other_formats = load(chat_path)
    assert other_formats.manifest.recipe["cache"]["window_format"] != small_pkg.manifest.recipe["cache"]["window_format"]
    for package in (other_weights_pkg, other_formats, other_recipe):
        with PrefixCache(package, l2_dir=tmp_path, write_behind=False) as cache:
            got = run(package, [prompt[:150]], cache)[0]
            s = cache.stats_dict()
            assert (s["lookups"], s["misses"], s["l2"]["identity_rejects"]) == (1, 1, 0)
            assert got[0] == run(package, [prompt[:150]])[0][0]
    with L2Store(tmp_path, 1 << 30) as store:  # the original's snapshot is still there, sound
        assert store.stats.checksum_failures == 0 and len(store.names()) == 4


def test_every_must_land_on_chunk_ends(small_pkg):
    with pytest.raises(ValueError, match="multiple of the prefill chunk 64"):
        PrefixCache(small_pkg, every=100)


def test_run_command_reuses_the_prompt_from_disk(small_path, tmp_path):
    args = ["run", str(small_path), "--prompt-ids", ",".join(map(str, range(3, 140))), "--max-new-tokens", "5",
            "--greedy", "--prefix-cache-dir", str(tmp_path), "--prefix-cache-bytes", str(64 << 20)]
    first = CliRunner().invoke(main, args, terminal_width=200)
    second = CliRunner().invoke(main, args, terminal_width=200)
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    tokens = [r.output.split("tokens: ")[1].splitlines()[0] for r in (first, second)]
    assert tokens[0] == tokens[1]
    assert re.search(r"prefix misses\s*│\s*1\s*│", first.output)
    assert re.search(r"prefix exact_hits\s*│\s*1\s*│", second.output)
    assert re.search(r"prefix prefill_tokens_saved\s*│\s*137\s*│", second.output)
