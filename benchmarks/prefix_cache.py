"""Prefix cache on CPU: time to first token with a cached prefix, and L2 read throughput.

* ttft: a 4096-token prompt whose first 3904 tokens (61 prefill chunks, about 3.9k) are
  cached, against prefilling it cold; the hit hydrates the snapshot and prefills the last
  192 tokens (3 chunks). Through L1 (the snapshot in memory) and through L2 (read from the
  directory, checksum verified, nothing in L1). Ratio = hit / cold: below 1 the cache pays
  off, and 1 / ratio is the speed-up. The first token is checked to be the same on every
  path before anything is timed (a hit at a chunk boundary is bitwise a cold prefill).
* l2_read: a whole L2 lookup (list, hash filter, read, checksum, parse, token compare)
  against `open(path).read()` of the same file; ratio = L2 / plain read. Both read from
  the page cache after the first round, so this is the CPU cost L2 adds to a read.
  Measured on the 3904-token snapshot and on a 64 MiB one (the size of a ~60k-token
  prefix of the full model).

The recipe is dsv41-tiny with max_seq_len raised to 4096 (the bundled one stops at 1024);
nothing else changes. Cold prefills take seconds, so ttft uses at most TTFT_ROUNDS rounds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.runtime import load
from b12x_toolchain.runtime.prefix.cache import PrefixCache
from b12x_toolchain.runtime.prefix.keys import Identity, token_bytes, token_hash
from b12x_toolchain.runtime.prefix.l2 import L2Store, file_name
from b12x_toolchain.runtime.prefix.snapshot import Snapshot
from b12x_toolchain.runtime.serving.speculative import Decoder
from benchmarks.registry import Settings, benchmark, compare_timed

RECIPE = "dsv41-tiny"
MAX_SEQ_LEN = 4096
PROMPT_TOKENS = 4096
PREFIX_TOKENS = 3904  # a multiple of the 64-token prefill chunk
TTFT_ROUNDS = 5
BIG_SNAPSHOT = 64 << 20
SEED = 0


def long_recipe():
    return recipe_variant(load_recipe(RECIPE), {"model.max_seq_len": MAX_SEQ_LEN}, name=f"{RECIPE}-{MAX_SEQ_LEN}")


def big_snapshot() -> Snapshot:
    ident = Identity.of({"benchmark": "l2_read"})
    tokens = token_bytes(range(60000))
    rows = torch.randint(0, 256, (BIG_SNAPSHOT // 288, 288), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(SEED))
    meta = {"cache.layer0.compressed": {"kind": "append", "ratio": 1, "rows": rows.shape[0]}}
    return Snapshot(ident, 60000, tokens, token_hash(ident.key, tokens), {"cache.layer0.compressed": rows}, meta)


def read_cases(directory: Path, snaps: dict, settings: Settings) -> list:
    out = []
    with L2Store(directory, 1 << 40) as store:
        for case, snap in snaps.items():
            store.put(snap)
            path = directory / file_name(snap)
            size = path.stat().st_size
            prompt = snap.tokens

            def plain(path=path):
                with open(path, "rb") as f:
                    return f.read()

            def ours(snap=snap, prompt=prompt):
                got = store.lookup(snap.identity, prompt)
                if got is None:
                    raise RuntimeError(f"{case}: the L2 lookup missed its own snapshot")
                return got

            m = compare_timed("prefix_cache.l2_read", case, plain, ours, settings, "plain read", "L2 lookup",
                              {"bytes": size})
            m.params["plain_MBps"] = size / m.baseline / 1e3
            m.params["l2_MBps"] = size / m.candidate / 1e3
            out.append(m)
    return out


@benchmark("prefix_cache")
def prefix_cache_benchmark(settings: Settings) -> list:
    rounds = Settings(repeat=min(settings.repeat, TTFT_ROUNDS), warmup=min(settings.warmup, 1))
    with tempfile.TemporaryDirectory(prefix="b12x-bench-prefix-") as tmp:
        tmp = Path(tmp)
        package = load(export_package(long_recipe(), tmp / "pkg").path)
        gen = torch.Generator().manual_seed(SEED)
        prompt = torch.randint(0, package.vocab_size, (PROMPT_TOKENS,), generator=gen).tolist()
        session = package.session(slots=1, max_rows=1)

        with PrefixCache(package, l2_dir=tmp / "l2", write_behind=False) as seed:
            Decoder(session, prefix_cache=seed).prefill(0, prompt[:PREFIX_TOKENS])
            [snap] = seed.l1.snapshots()
        l1 = PrefixCache(package, end_of_prompt=False)
        l1.l1.insert(snap)
        l2 = PrefixCache(package, l1_bytes=0, l2_dir=tmp / "l2", end_of_prompt=False, write_behind=False)

        def ttft(cache):
            decoder = Decoder(session, prefix_cache=cache)
            return lambda: decoder.prefill(0, prompt).pending

        cold, from_l1, from_l2 = ttft(None), ttft(l1), ttft(l2)
        first = {cold(), from_l1(), from_l2()}
        if len(first) != 1:
            raise RuntimeError(f"first tokens differ between cold, L1 and L2: {first}")
        params = {"prompt": PROMPT_TOKENS, "cached": PREFIX_TOKENS, "snapshot_bytes": snap.nbytes}
        out = [compare_timed("prefix_cache.ttft", case, cold, fn, rounds, "cold prefill", label, dict(params))
               for case, fn, label in (("L1 hit vs cold", from_l1, "L1 hit"), ("L2 hit vs cold", from_l2, "L2 hit"))]
        for m in out:
            m.params["speedup"] = m.baseline / m.candidate
        stats = {"l1": l1.stats_dict(), "l2": l2.stats_dict()}
        if any(s["misses"] for s in stats.values()):
            raise RuntimeError(f"a timed lookup missed: {stats}")
        l2.close()
        out += read_cases(tmp / "read", {f"{PREFIX_TOKENS}-token snapshot": snap, "64 MiB snapshot": big_snapshot()},
                          settings)
    return out
