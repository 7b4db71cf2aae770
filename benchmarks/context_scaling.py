"""Does a pass's cost follow the request's committed length, or the recipe's max_seq_len?

Op set v3's attention ops (`runtime/ops/sparse_ops.py`) read only the entries a request
has committed, through its block table into paged caches, so the same request should
cost the same whatever capacity its caches were sized for. Two groups of rows:

* verify, draft, prefill: the `dsv41-tiny` recipe exported with `model.max_seq_len` set
  to 1k, 16k, 256k and 1M (nothing else changed; the very same weights), one CPU session
  with one slot each, the same 150-token prompt prefilled (three 64-token chunks), then
  the verify and draft passes replayed at that committed length and the whole prefill
  timed and divided by its chunks. Baseline: the 1k package; candidate: a larger one;
  ratio = larger / 1k, so about 1 means the capacity costs nothing. Before timing, every
  output of every replay (and the prompt's first token) is checked to be identical to the
  1k package's: the variants must do the very same work.
* indexer: `torch.ops.b12x_toolchain.indexer_topk` called directly, on random index keys
  encoded in the recipe's index format and paged (PAGE_RECORDS records per page, the
  row's block table mapping its pages in shuffled order, pages past the stored keys
  poisoned), at the verify width, with the recipe's indexer heads, dims and top-k,
  ratio 1, no candidates. Committed 4k and 16k against 1k (cache capacity 16k): it
  should grow with what is committed (ratio about 4 and 16). Capacity 1M against 16k at
  committed 1k: it should not grow with the capacity (ratio about 1).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch

from b12x_toolchain.exporter.model.weights import init_weights, weight_shapes
from b12x_toolchain.exporter.pipeline.export import export_package
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.exporter.recipe.variants import recipe_variant
from b12x_toolchain.runtime import load, read_manifest
from b12x_toolchain.runtime.formats.codecs import get_format
from b12x_toolchain.runtime.ops.opset import ops  # noqa: F401  (registers torch.ops.b12x_toolchain)
from b12x_toolchain.runtime.serving.speculative import Decoder
from benchmarks.registry import Settings, benchmark, compare_timed

RECIPE = "dsv41-tiny"
MAX_SEQ_LENS = (1 << 10, 1 << 14, 1 << 18, 1 << 20)  # the first is every comparison's baseline
PROMPT_TOKENS = 150  # three prefill chunks, past the 128-token window
INDEXER_COMMITTED = (1 << 10, 1 << 12, 1 << 14)  # the first is the baseline
INDEXER_CAPACITIES = (1 << 14, 1 << 20)  # the first holds every committed length above
PAGE_RECORDS = 64  # index-key records (tokens, at ratio 1) per page of the indexer rows' cache
EXPORT_JOBS = 2  # passes exported at once, in worker processes
SEED = 0


def size_label(n: int) -> str:
    """1024 -> '1k', 262144 -> '256k', 1048576 -> '1M'."""
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n % (1 << 10) == 0:
        return f"{n >> 10}k"
    return str(n)


def variant(base, max_seq_len: int):
    """`base` with model.max_seq_len replaced and its name suffixed."""
    name = f"{base.name}-{size_label(max_seq_len).lower()}"  # names are lower case
    return recipe_variant(base, {"model.max_seq_len": max_seq_len}, name=name)


def shared_weights(recipes) -> dict[str, torch.Tensor]:
    """One set of random weights that fits every recipe: the weights' names and shapes do not
    depend on max_seq_len (only the caches do), and this checks it."""
    shapes = [weight_shapes(Dims.from_recipe(r)) for r in recipes]
    seeds = {r.model.init_seed for r in recipes}
    if any(s != shapes[0] for s in shapes) or len(seeds) != 1:
        raise RuntimeError("the recipe variants do not share their weights' shapes and seed")
    return init_weights(Dims.from_recipe(recipes[0]), recipes[0].model.init_seed)


def _reusable(path: Path, recipe) -> bool:
    try:
        manifest = read_manifest(path)
    except Exception:  # noqa: BLE001  (unreadable or from another format version: export again)
        return False
    return manifest.recipe_sha256 == recipe.sha256() and bool(manifest.rewrites.pipeline)


def package_path(recipe, directory: Path, weights: dict, jobs: int = EXPORT_JOBS) -> Path:
    """The fused package of `recipe` with `weights` in `directory`: the one already there for
    the same recipe (its weights are checked in `check_weights`), else a fresh export."""
    path = Path(directory) / recipe.name / f"{recipe.name}.b12x"
    if _reusable(path, recipe):
        return path
    return export_package(recipe, Path(directory) / recipe.name, weights=weights, jobs=jobs).path


def packages(recipes, directory: Path, weights: dict, jobs: int = EXPORT_JOBS) -> list:
    # load() reads every file, so the packages outlive a temporary directory.
    return [load(package_path(recipe, directory, weights, jobs)) for recipe in recipes]


def check_weights(pkgs) -> None:
    first = pkgs[0].weights
    for pkg in pkgs[1:]:
        if set(pkg.weights) != set(first) or not all(torch.equal(pkg.weights[k], first[k]) for k in first):
            raise RuntimeError(f"{pkg.manifest.name}: weights differ from {pkgs[0].manifest.name}'s")


def check_same(what: str, got: dict, expected: dict) -> None:
    # Timing two variants against each other only means something if they do the same work.
    for name in expected:
        if not torch.equal(got[name], expected[name]):
            diff = (got[name].float() - expected[name].float()).abs().max().item()
            raise RuntimeError(f"{what}: output {name} differs (max abs difference {diff}), "
                               "so the timings are not comparable")


class Prefilled:
    """One slot holding the prompt, and the replays the benchmark times on it.

    Verify and draft only write staging, so they can be replayed again and again at the
    committed length the prompt leaves; a prefill round resets the slot and prefills the
    whole prompt again, leaving the same state behind.
    """

    def __init__(self, package, prompt: list[int]):
        self.package = package
        self.max_seq_len = package.manifest.model.max_seq_len
        self.session = package.session(device="cpu", slots=1, max_rows=1)
        self.decoder = Decoder(self.session)
        self.prompt = prompt
        self.chunk = package.passes["prefill"].width
        self.first_token = self.prefill()
        self.committed = self.session.seq_lens[0]
        self.inputs = {name: self._inputs(name) for name in ("verify", "draft")}

    def prefill(self) -> int:
        return self.decoder.prefill(0, self.prompt).pending

    def _inputs(self, pass_name: str) -> dict[str, torch.Tensor]:
        width = self.package.passes[pass_name].width
        gen = torch.Generator().manual_seed(SEED + width)  # the same tokens for every package
        return {"token_ids": torch.randint(0, self.package.vocab_size, (1, width), dtype=torch.int32, generator=gen),
                "slot_ids": torch.tensor([0], dtype=torch.int32),
                "positions": torch.tensor([self.committed], dtype=torch.int32)}

    def replay(self, pass_name: str) -> dict[str, torch.Tensor]:
        return self.session.replay(pass_name, **self.inputs[pass_name])

    def outputs(self, pass_name: str) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.replay(pass_name).items()}

    @property
    def cache_bytes(self) -> int:
        """Persistent cache bytes of one slot: its rows of the per-slot caches (the session
        also holds the scratch slot's) plus the pages the session's pools hold per slot
        (by default, enough for every slot to reach max_seq_len; the scratch slot has none)."""
        session = self.session
        paged = {name for caches in session.pages.caches.values() for name in caches}
        rings = sum(t.nbytes for name, t in session.caches.items() if name not in paged) // (session.slots + 1)
        return rings + sum(pool.count * pool.page_bytes for pool in session.pages.pools.values()) // session.slots


def per_chunk(m, chunks: int):
    """A whole-prompt prefill measurement as time per chunk (the ratio does not change)."""
    m.baseline, m.candidate = m.baseline / chunks, m.candidate / chunks
    m.baseline_samples = [s / chunks for s in m.baseline_samples]
    m.candidate_samples = [s / chunks for s in m.candidate_samples]
    return m


def model_cases(pkgs, settings: Settings, prompt_tokens: int = PROMPT_TOKENS) -> list:
    """verify, draft and prefill-per-chunk rows: every package against the first (the smallest)."""
    check_weights(pkgs)
    gen = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, pkgs[0].vocab_size, (prompt_tokens,), generator=gen).tolist()
    base, *others = [Prefilled(pkg, prompt) for pkg in pkgs]
    expected = {p: base.outputs(p) for p in ("verify", "draft")}
    chunks = math.ceil(prompt_tokens / base.chunk)
    rows = {"verify": [], "draft": [], "prefill_chunk": []}
    for other in others:
        if other.first_token != base.first_token:
            raise RuntimeError(f"max_seq_len {other.max_seq_len}: first token {other.first_token}, "
                               f"{base.first_token} at {base.max_seq_len}")
        for pass_name in ("verify", "draft"):
            check_same(f"{pass_name} at max_seq_len {other.max_seq_len}", other.outputs(pass_name),
                       expected[pass_name])
        case = f"{size_label(other.max_seq_len)} vs {size_label(base.max_seq_len)}"
        labels = (f"max_seq_len {size_label(base.max_seq_len)}", f"max_seq_len {size_label(other.max_seq_len)}")
        params = {"max_seq_len": [base.max_seq_len, other.max_seq_len], "committed": base.committed, "rows": 1,
                  "slot_cache_bytes": [base.cache_bytes, other.cache_bytes], "outputs_identical": True,
                  "first_token": base.first_token}
        for pass_name in ("verify", "draft"):
            rows[pass_name].append(compare_timed(
                f"context_scaling.{pass_name}", case, lambda b=base, p=pass_name: b.replay(p),
                lambda o=other, p=pass_name: o.replay(p), settings, *labels,
                {**params, "width": base.package.passes[pass_name].width}))
        rows["prefill_chunk"].append(per_chunk(compare_timed(
            "context_scaling.prefill_chunk", case, base.prefill, other.prefill, settings, *labels,
            {**params, "committed": 0, "prompt": prompt_tokens, "chunk": base.chunk, "chunks": chunks}), chunks))
    return rows["verify"] + rows["draft"] + rows["prefill_chunk"]


class IndexerCall:
    """indexer_topk on one row at committed length `committed`, its pages sized for `capacity`.

    The index keys are paged as op set v3 stores them: a pool of ceil(capacity /
    PAGE_RECORDS) pages of PAGE_RECORDS records each (ratio 1: one record per token), the
    row's block table [1, pages_per_slot] mapping its pages to a shuffled order of the
    pool's pages (a page id says nothing about where a row's entries are), every key
    written through it. Only the block table's first ceil(committed / PAGE_RECORDS)
    columns are live; the op must read no more than those, and pages holding no key are
    0xFF bytes (NaN scales), which would change the choice if it read them.
    """

    def __init__(self, d: Dims, keys: torch.Tensor, committed: int, capacity: int, gen: torch.Generator):
        fmt = get_format(d.index_format)
        T, H, D = d.verify_width, d.index_heads, d.index_head_dim
        self.committed, self.capacity, self.d = committed, capacity, d
        pages = -(-capacity // PAGE_RECORDS)
        record = fmt.row_bytes(D)
        self.cache = torch.full((pages, PAGE_RECORDS * record), 0xFF, dtype=torch.uint8)
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(SEED + pages))
        self.block_table = order[None].to(torch.int32)  # [1, pages_per_slot]
        self.pages_used = -(-committed // PAGE_RECORDS)
        stored = min(capacity, keys.shape[0])
        records = torch.zeros(-(-stored // PAGE_RECORDS) * PAGE_RECORDS, record, dtype=torch.uint8)
        fmt.encode(keys[:stored], out=records[:stored])
        self.cache.view(pages, PAGE_RECORDS, record)[order[: records.shape[0] // PAGE_RECORDS]] = \
            records.view(-1, PAGE_RECORDS, record)
        self.q = torch.randn(1, T, H, D, generator=gen)
        self.head_weights = torch.randn(1, T, H, generator=gen) * H ** -0.5
        self.new_keys = torch.randn(1, T, D, generator=gen)
        self.positions = torch.tensor([committed], dtype=torch.int32)  # ratio 1: committed entries = positions

    def __call__(self) -> torch.Tensor:
        d = self.d
        return torch.ops.b12x_toolchain.indexer_topk(self.q, self.head_weights, self.cache, self.new_keys,
                                                     self.block_table, self.positions, None, 1,
                                                     d.candidate_block_size, d.index_topk, d.index_format)


def indexer_cases(d: Dims, settings: Settings, committed=INDEXER_COMMITTED, capacities=INDEXER_CAPACITIES) -> list:
    """indexer_topk against committed length (at the first capacity) and against capacity
    (at the first committed length); ratio = candidate / baseline."""
    small, large = capacities
    if max(committed) > small:
        raise ValueError(f"capacity {small} cannot hold committed length {max(committed)}")
    keys = torch.randn(max(committed), d.index_head_dim, generator=torch.Generator().manual_seed(SEED))

    def call(n: int, capacity: int) -> IndexerCall:
        return IndexerCall(d, keys, n, capacity, torch.Generator().manual_seed(SEED + 1))  # the same queries

    params = {"ratio": 1, "width": d.verify_width, "heads": d.index_heads, "dim": d.index_head_dim,
              "topk": d.index_topk, "format": d.index_format, "page_records": PAGE_RECORDS}
    base = call(committed[0], small)
    out = []
    for n in committed[1:]:
        other = call(n, small)
        m = compare_timed("context_scaling.indexer", f"committed {size_label(n)} vs {size_label(committed[0])}",
                          base, other, settings, f"committed {size_label(committed[0])}", f"committed {size_label(n)}",
                          {**params, "committed": [committed[0], n], "capacity": [small, small],
                           "linear_ratio": n / committed[0]})
        m.params["ms_per_1k_entries"] = [m.baseline / committed[0] * 1024, m.candidate / n * 1024]
        out.append(m)
    other = call(committed[0], large)
    if not torch.equal(base(), other()):
        raise RuntimeError("indexer_topk: the same committed keys chose differently in a larger cache")
    out.append(compare_timed("context_scaling.indexer",
                             f"capacity {size_label(large)} vs {size_label(small)} at committed {size_label(committed[0])}",
                             base, other, settings, f"capacity {size_label(small)}", f"capacity {size_label(large)}",
                             {**params, "committed": [committed[0], committed[0]], "capacity": [small, large],
                              "outputs_identical": True}))
    return out


def exported_variants(max_seq_lens, settings: Settings, jobs: int = EXPORT_JOBS) -> list:
    """Loaded packages of RECIPE at each of `max_seq_lens`, one set of weights for all: in
    `settings.exports` (`--exports DIR`), reusing the packages already there, else exported
    into a temporary directory. Other benchmarks take their long-context packages from here,
    so one DIR serves them all."""
    recipes = [variant(load_recipe(RECIPE), n) for n in max_seq_lens]
    weights = shared_weights(recipes)
    if settings.exports is not None:
        return packages(recipes, settings.exports, weights, jobs)
    with tempfile.TemporaryDirectory(prefix="b12x-bench-context-") as tmp:
        return packages(recipes, Path(tmp), weights, jobs)


@benchmark("context_scaling")
def context_scaling_benchmark(settings: Settings) -> list:
    pkgs = exported_variants(MAX_SEQ_LENS, settings)
    return model_cases(pkgs, settings) + indexer_cases(Dims.from_recipe(load_recipe(RECIPE)), settings)
