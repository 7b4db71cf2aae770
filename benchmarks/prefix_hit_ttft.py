"""Does an L1 prefix hit's time to first token stay flat as the cached prefix grows?

`dsv41-tiny` at max_seq_len 256k (context_scaling's 256k variant, reused with
`--exports`), one CPU session of two slots. For prefixes P of 1k, 4k and 16k random
tokens (one independent prefix each: L1 drops a snapshot once a longer one of the same
tokens arrives), P is prefilled in slot 0 and stored with `PrefixCache.store` at its end —
a multiple of the prefill chunk, so a hit resumes exactly where a cold prefill's chunks
would be — into an L1-only cache, which holds the snapshot by reference to the session's
pages; the slot is then retired. The request prompt = P + the same 64-token tail is
served in slot 1 for one new token:

* cold: a fresh slot prefills P + 64 tokens (no prefix cache);
* hit: the cache hydrates the P-token snapshot into slot 1 — its pages adopted, only the
  per-slot rings copied — and prefills the 64-token tail.

Time to first token is the engine's own (`RequestState.first_token_s`: submission to the
first token, admission, hydration and prefill included). Every hit's first token is
checked to be the cold prefill's (a difference stops the run). Rows:

* `prefix_hit_ttft.hit_vs_cold`: hit / cold per prefix; below 1 the cache pays off.
* `prefix_hit_ttft.hit_vs_1k_hit`: a 4k or 16k hit against the 1k hit; the goal is within
  1.3x: a hit should cost the tail, not the prefix.
* `prefix_hit_ttft.restore_vs_1k`: `PrefixCache.restore` alone (lookup and hydration,
  no prefill) at 4k or 16k against 1k: what the hit costs before its tail is prefilled.
* `prefix_hit_ttft.pages_copied`: pages the hit's snapshot shares by reference against
  the pages copied while hydrating it (`session.pages.hydrate_copies`) or before its tail
  was written (copy-on-write): 0, so the ratio is 0.

Cold prefills of 16k tokens take tens of seconds on CPU, so cold rounds are capped at
COLD_ROUNDS (1 at the longest prefix); hits are cheap and run HIT_ROUNDS.
"""

from __future__ import annotations

import torch

from b12x_toolchain.runtime.prefix.cache import PrefixCache
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from b12x_toolchain.runtime.serving.speculative import Decoder
from benchmarks.context_scaling import exported_variants, size_label
from benchmarks.registry import Measurement, Settings, benchmark, compare_counts, compare_rates, compare_timed

MAX_SEQ_LEN = 1 << 18
PREFIXES = (1 << 10, 1 << 12, 1 << 14)  # the first is the hits' baseline
TAIL = 64
COLD_ROUNDS = {1 << 10: 3, 1 << 12: 2, 1 << 14: 1}  # at most, whatever --repeat says
HIT_ROUNDS = 5
HIT_GOAL = 1.3
SEED = 0


class TTFT:
    """Serves prompts of one prefix length for one new token in `slot`; each call returns the
    time to first token in ms and records the first token and what the hit copied."""

    def __init__(self, session, prompt: list[int], slot: int, cache=None):
        self.session, self.prompt, self.cache = session, prompt, cache
        self.engine = Engine(session, slots=[slot], prefix_cache=cache)
        self.tokens, self.hydrate_copies, self.cow_copies, self.saved = set(), 0, 0, set()

    def __call__(self) -> float:
        pages = self.session.pages
        hydrated, copied = pages.hydrate_copies, sum(p.copied for p in pages.pools.values())
        saved = self.cache.stats.prefill_tokens_saved if self.cache is not None else 0
        [state] = self.engine.generate([Request(self.prompt, max_new_tokens=1)])
        self.tokens.add(state.tokens[0])
        self.hydrate_copies += pages.hydrate_copies - hydrated
        self.cow_copies += sum(p.copied for p in pages.pools.values()) - copied
        if self.cache is not None:
            self.saved.add(self.cache.stats.prefill_tokens_saved - saved)
        return state.first_token_s * 1e3


def seed_prefix(session, cache, prefix: list[int], slot: int = 0) -> None:
    """Prefill `prefix` in `slot` and store its snapshot; the slot is retired after (the
    snapshot keeps its pages)."""
    Decoder(session).prefill(slot, prefix)
    if cache.store(session, slot, prefix) is None:
        raise RuntimeError(f"the {len(prefix)}-token prefix was not stored: {cache.stats_dict()}")
    session.retire_slot(slot)


class Restore:
    """`cache.restore` alone (lookup and hydration, no prefill) of a prompt into `slot`."""

    def __init__(self, session, cache, prompt: list[int], slot: int, length: int):
        self.session, self.cache, self.prompt, self.slot, self.length = session, cache, prompt, slot, length

    def __call__(self) -> None:
        hit = self.cache.restore(self.session, self.slot, self.prompt)
        if hit is None or hit.length != self.length:
            raise RuntimeError(f"restore of the {self.length}-token prefix missed")


def shared_pages(cache, length: int) -> int:
    snaps = [s for s in cache.l1.snapshots() if s.length == length]
    if len(snaps) != 1 or snaps[0].pages is None:
        raise RuntimeError(f"expected one by-reference snapshot of {length} tokens in L1")
    return sum(len(ids) for ids in snaps[0].pages.ids.values())


def measure(package, settings: Settings, prefixes=PREFIXES, tail: int = TAIL, cold_rounds=None,
            hit_rounds: int = HIT_ROUNDS) -> list[Measurement]:
    cold_rounds = COLD_ROUNDS if cold_rounds is None else cold_rounds
    chunk = package.passes["prefill"].width
    if any(p % chunk for p in prefixes):
        raise ValueError(f"prefixes {prefixes} must be multiples of the prefill chunk {chunk}")
    gen = torch.Generator().manual_seed(SEED)
    tail_tokens = torch.randint(0, package.vocab_size, (tail,), generator=gen).tolist()
    session = package.session(device="cpu", slots=2, max_rows=1)
    cache = PrefixCache(package, end_of_prompt=False)  # L1 only (no l2_dir); stores only when told
    if not cache.enabled:
        raise RuntimeError(f"prefix snapshots are off for this package: {cache.reason}")
    prefix = {n: torch.randint(0, package.vocab_size, (n,), generator=gen).tolist() for n in prefixes}
    for n in prefixes:
        seed_prefix(session, cache, prefix[n])
    warmup = min(settings.warmup, 1)
    out, colds, hits = [], {}, {}
    for n in prefixes:
        prompt = prefix[n] + tail_tokens
        cold, hit = TTFT(session, prompt, 1), TTFT(session, prompt, 1, cache)
        for _ in range(warmup):
            hit()  # cheap; a cold round is not, and the first is no different from the next
        rounds = Settings(repeat=min(settings.repeat, cold_rounds.get(n, 1)), warmup=0)
        params = {"prefix": n, "tail": tail, "prompt": n + tail, "first_token_identical": True,
                  "max_seq_len": package.manifest.model.max_seq_len}
        m = compare_rates("prefix_hit_ttft.hit_vs_cold", f"prefix {size_label(n)} + {tail}", cold, hit, rounds,
                          "cold prefill", "L1 hit", "ms", params)
        m.params["speedup"] = m.baseline / m.candidate
        out.append(m)
        colds[n], hits[n] = cold, hit
    base = hits[prefixes[0]]
    hit_settings = Settings(repeat=min(settings.repeat, hit_rounds), warmup=warmup)
    for n in prefixes[1:]:
        m = compare_rates("prefix_hit_ttft.hit_vs_1k_hit", f"hit {size_label(n)} vs {size_label(prefixes[0])}",
                          base, hits[n], hit_settings, f"hit, prefix {size_label(prefixes[0])}",
                          f"hit, prefix {size_label(n)}", "ms",
                          {"prefix": [prefixes[0], n], "tail": tail, "goal": HIT_GOAL})
        m.params["within_goal"] = m.ratio <= HIT_GOAL
        out.append(m)
    restores = {n: Restore(session, cache, prefix[n] + tail_tokens, 1, n) for n in prefixes}
    for n in prefixes[1:]:
        case = f"restore {size_label(n)} vs {size_label(prefixes[0])}"
        pages = [shared_pages(cache, prefixes[0]), shared_pages(cache, n)]
        out.append(compare_timed("prefix_hit_ttft.restore_vs_1k", case, restores[prefixes[0]], restores[n],
                                 hit_settings, f"restore, prefix {size_label(prefixes[0])}",
                                 f"restore, prefix {size_label(n)}",
                                 {"prefix": [prefixes[0], n], "shared_pages": pages}))
    session.retire_slot(1)
    for n, hit in hits.items():
        if hit.saved != {n}:
            raise RuntimeError(f"prefix {n}: hits skipped {hit.saved} tokens, expected {n}")
        if len(colds[n].tokens | hit.tokens) != 1:  # a snapshot at a chunk boundary: bitwise the cold prefill
            raise RuntimeError(f"prefix {n}: first token {hit.tokens} after a hit, {colds[n].tokens} cold")
        shared = shared_pages(cache, n)
        out.append(compare_counts("prefix_hit_ttft.pages_copied", f"prefix {size_label(n)}", shared,
                                  hit.hydrate_copies + hit.cow_copies, "pages", "pages shared by reference",
                                  "pages copied", {"prefix": n, "hydrate_copies": hit.hydrate_copies,
                                                   "copy_on_write": hit.cow_copies,
                                                   "snapshot_copies": session.pages.snapshot_copies,
                                                   "session_hydrate_copies": session.pages.hydrate_copies}))
    stats = cache.stats_dict()
    if stats["misses"] or stats["hydrate_errors"] or stats["l1"]["entries"] != len(prefixes):
        raise RuntimeError(f"a timed lookup missed or failed, or a snapshot was dropped: {stats}")
    return out


@benchmark("prefix_hit_ttft")
def prefix_hit_ttft_benchmark(settings: Settings) -> list:
    [package] = exported_variants((MAX_SEQ_LEN,), settings)
    return measure(package, settings)
