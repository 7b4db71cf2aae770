"""Does cache memory follow the tokens requests hold, now that entries and index keys are paged?

Two parts, both deterministic byte counts (`compare_counts`, one value per side):

* serving: `dsv41-tiny` exported at max_seq_len 1M (context_scaling's 1M variant and its
  `--exports` reuse), one CPU session of 64 slots whose page pools hold exactly the pages
  its requests may reserve (`pages=`: per pool, the sum over the requests of the pages
  their span needs; a span is prompt + new tokens + one verify block, as the engine
  reserves it), serving 64 requests of 20..200 random prompt tokens and a few new tokens
  each through an Engine. After every replay the pages in use and the tokens the slots
  hold are sampled; at the peak the bytes in use are set against the tokens held and
  against what the contiguous layout (every slot at max_seq_len: 64 x pages_per_slot pages
  of every pool) would allocate.
* full size: the `dsv41` recipe's cache specs (no export): per page pool, the bytes one
  token held takes (the sum over the pool's caches of page_bytes / tokens_per_page), and
  per slot the bytes of the per-slot rings (window rings, compressor states, drafter
  caches, seq_len), which do not depend on the tokens held. A slot holding T tokens takes
  rings + ceil(T / tokens_per_page) pages per pool, against the contiguous slot's rings +
  pages_per_slot pages.

A second benchmark, `session_memory`, measures what opening a session costs in resident
memory. Each sample is a fresh process (`python -m benchmarks.paged_memory PACKAGE MODE
SLOTS`): it loads the package, resets its peak-RSS mark (/proc/self/clear_refs), opens
`package.session(slots=SLOTS)` and reports its RSS increase and peak. Modes: "default"
(the pools a share of free memory holds, buffers committed as they are written), a number
(the same with that memory_fraction: BUDGET_FRACTION is small enough that the 1M pools hold
fewer pages than every slot at max_seq_len on any machine with less than 100 GiB free) and
"zero-filled" (the session's former default: pools for every slot at max_seq_len, every
buffer written with torch.zeros at open). The children but the zero-filled one then serve
the 64 requests of the engine's 64-request test (their prompts and lengths; no stop tokens)
through an Engine with the draft pass, on the 1M package with 64 slots and on the 1k
package with 8 slots, as that test does; the tokens must be identical.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from b12x_toolchain.exporter.model.pass_modules import PASSES
from b12x_toolchain.exporter.recipe.dims import Dims
from b12x_toolchain.exporter.recipe.loader import load_recipe
from b12x_toolchain.runtime.package.contract import CachePages
from b12x_toolchain.runtime.prefix.snapshot import cache_specs as package_cache_specs
from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from benchmarks.context_scaling import exported_variants, size_label
from benchmarks.registry import Measurement, Settings, benchmark, compare_counts

MAX_SEQ_LEN = 1 << 20
SLOTS = 64
REQUESTS = 64
PROMPT_TOKENS = (20, 200)  # inclusive range of prompt lengths
NEW_TOKENS = 4
FULL_RECIPE = "dsv41"
FULL_TOKENS = (1 << 10, 1 << 14, 1 << 18)  # tokens a full-size slot holds, against a contiguous slot
SEED = 0


# -- byte accounting from cache specs (BufferSpecs of role "cache"): recipe or package ---------


@dataclass(frozen=True)
class PoolBytes:
    """One page pool: the caches sharing its page ids, and what a page and a token take."""

    pool: str
    caches: int
    tokens_per_page: int
    pages_per_slot: int
    page_bytes: int  # one page across every cache of the pool
    record_bytes_per_token: float  # the sum over its caches of record_bytes / tokens_per_entry
    bytes_per_token: float  # the sum over its caches of page_bytes / tokens_per_page

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_page)

    def bytes_for(self, tokens: int) -> int:
        """What a slot holding `tokens` takes of this pool: whole pages."""
        return self.pages_for(tokens) * self.page_bytes

    @property
    def slot_bytes(self) -> int:
        """A contiguous slot: pages for max_seq_len."""
        return self.pages_per_slot * self.page_bytes


@dataclass(frozen=True)
class RingBytes:
    """Per-slot caches of one kind: their bytes per slot, whatever the slot holds."""

    kind: str
    caches: int
    slot_bytes: int


def pool_bytes(specs) -> dict[str, PoolBytes]:
    pages: dict[str, list[CachePages]] = {}
    for spec in specs:
        if spec.info is not None and isinstance(spec.info.page, CachePages):
            pages.setdefault(spec.info.page.pool, []).append(spec.info.page)
    out = {}
    for pool, entries in sorted(pages.items()):
        geometry = {(p.tokens_per_page, p.pages_per_slot) for p in entries}
        if len(geometry) != 1:
            raise ValueError(f"pool {pool}: its caches disagree on tokens per page and pages per slot: {geometry}")
        [(tokens_per_page, pages_per_slot)] = geometry
        out[pool] = PoolBytes(pool, len(entries), tokens_per_page, pages_per_slot, sum(p.page_bytes for p in entries),
                              sum(p.record_bytes / p.tokens_per_entry for p in entries),
                              sum(p.page_bytes / p.tokens_per_page for p in entries))
    return out


def ring_bytes(specs) -> dict[str, RingBytes]:
    """Per-slot caches (shape ["slots", ...]) by kind; bytes of one slot's rows."""
    counts, sizes = {}, {}
    for spec in specs:
        if spec.info is None or isinstance(spec.info.page, CachePages):
            continue
        if not spec.shape or spec.shape[0] != "slots" or any(isinstance(d, str) for d in spec.shape[1:]):
            raise ValueError(f"{spec.name}: a per-slot cache should be [slots, ...], got {list(spec.shape)}")
        kind = spec.info.kind
        counts[kind] = counts.get(kind, 0) + 1
        sizes[kind] = sizes.get(kind, 0) + math.prod(spec.shape[1:]) * spec.torch_dtype.itemsize
    return {kind: RingBytes(kind, counts[kind], sizes[kind]) for kind in counts}


def slot_bytes(pools: dict[str, PoolBytes], rings: dict[str, RingBytes], tokens: int | None) -> int:
    """One slot holding `tokens` paged (None: the contiguous layout, every pool at max_seq_len)."""
    paged = sum(p.slot_bytes if tokens is None else p.bytes_for(tokens) for p in pools.values())
    return sum(r.slot_bytes for r in rings.values()) + paged


def full_size_specs(recipe: str = FULL_RECIPE) -> list:
    return PASSES["prefill"](Dims.from_recipe(load_recipe(recipe))).caches()


def byte_table(pools: dict[str, PoolBytes], rings: dict[str, RingBytes], title: str) -> str:
    """The per-kind figures as a plain-text table (printed by the benchmark)."""
    head = ("cache kind", "caches", "tokens/page", "page bytes", "bytes/token", "bytes/slot")
    rows = [(p.pool, p.caches, p.tokens_per_page, p.page_bytes, f"{p.bytes_per_token:g}", "-")
            for p in pools.values()]
    rows += [(r.kind, r.caches, "-", "-", "-", r.slot_bytes) for r in rings.values()]
    rows.append(("paged, all pools", sum(p.caches for p in pools.values()), "-", "-",
                 f"{sum(p.bytes_per_token for p in pools.values()):g}", "-"))
    rows.append(("per slot, all rings", sum(r.caches for r in rings.values()), "-", "-", "-",
                 sum(r.slot_bytes for r in rings.values())))
    cells = [tuple(str(c) for c in row) for row in [head, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    line = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    rule = "-" * len(line(cells[0]))
    return "\n".join([title, rule, line(cells[0]), rule, *map(line, cells[1:]), rule])


def full_size_cases(specs, label: str = FULL_RECIPE, tokens=FULL_TOKENS) -> list[Measurement]:
    """Per pool: bytes per token of its pages against its records' own (1: pages pad nothing);
    per ring kind: its share of a slot's rings; a slot holding T tokens against a contiguous one."""
    pools, rings = pool_bytes(specs), ring_bytes(specs)
    out = []
    for p in pools.values():
        out.append(compare_counts("paged_memory.full_size_per_token", f"{label} {p.pool}", p.record_bytes_per_token,
                                  p.bytes_per_token, "bytes/token", "records", "pages",
                                  {"caches": p.caches, "tokens_per_page": p.tokens_per_page,
                                   "page_bytes": p.page_bytes, "pages_per_slot": p.pages_per_slot}))
    ring_total = sum(r.slot_bytes for r in rings.values())
    for r in rings.values():
        out.append(compare_counts("paged_memory.full_size_rings", f"{label} {r.kind}", ring_total, r.slot_bytes,
                                  "bytes/slot", "all per-slot caches", r.kind, {"caches": r.caches}))
    contiguous = slot_bytes(pools, rings, None)
    max_seq_len = max(p.pages_per_slot * p.tokens_per_page for p in pools.values())
    for n in (n for n in tokens if n <= max_seq_len):
        paged = slot_bytes(pools, rings, n)
        out.append(compare_counts("paged_memory.full_size_slot", f"{label} slot, {size_label(n)} tokens",
                                  contiguous, paged, "bytes", f"contiguous slot ({size_label(max_seq_len)})",
                                  f"paged, {size_label(n)} tokens",
                                  {"tokens": n, "ring_bytes": ring_total, "paged_bytes": paged - ring_total,
                                   "bytes_per_token": sum(p.bytes_per_token for p in pools.values())}))
    return out


# -- serving: memory follows tokens -------------------------------------------------------------


def request_set(vocab_size: int, count: int = REQUESTS, lengths=PROMPT_TOKENS, new_tokens: int = NEW_TOKENS,
                seed: int = SEED) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=gen).tolist()
    return [Request(torch.randint(0, vocab_size, (n,), generator=gen).tolist(), new_tokens) for n in sizes]


def pages_wanted(pools: dict[str, PoolBytes], requests, verify_width: int, max_seq_len: int) -> dict[str, int]:
    """Per pool, the pages every request may reserve at once: the engine's span is prompt +
    new tokens + one verify block, at most max_seq_len (`Engine.span`)."""
    spans = [min(len(r.prompt) + r.max_new_tokens + verify_width, max_seq_len) for r in requests]
    return {name: sum(p.pages_for(s) for s in spans) for name, p in pools.items()}


class PeakSampler:
    """Wraps a session's replay: after each one, the pages in use and the tokens the slots hold."""

    def __init__(self, session):
        self.session, self.replay = session, session.replay
        self.peak_bytes, self.peak_pages, self.peak_tokens, self.samples = 0, {}, 0, 0
        session.replay = self

    def __call__(self, pass_name: str, **values):
        out = self.replay(pass_name, **values)
        self.sample()
        return out

    def sample(self) -> None:
        pools = self.session.pages.pools
        in_use = {name: pool.stats().in_use for name, pool in pools.items()}
        used = sum(in_use[name] * pool.page_bytes for name, pool in pools.items())
        tokens = sum(self.session.seq_lens[: self.session.slots])
        self.samples += 1
        if used > self.peak_bytes:
            self.peak_bytes, self.peak_pages, self.peak_tokens = used, in_use, tokens

    def close(self) -> None:
        del self.session.replay  # the instance attribute: the class's replay again


def serve(package, requests, slots: int = SLOTS) -> dict:
    """Serve `requests` on a session whose pools hold what they may reserve; byte counts at the peak."""
    pools = pool_bytes(package_cache_specs(package))
    max_seq_len = package.manifest.model.max_seq_len
    pages = pages_wanted(pools, requests, package.passes["verify"].width, max_seq_len)
    session = package.session(device="cpu", slots=slots, pages=pages)
    sampler = PeakSampler(session)
    try:
        engine = Engine(session)
        states = engine.generate(requests)
    finally:
        sampler.close()
    if any(not s.done for s in states):
        raise RuntimeError("a request did not finish")
    held = {name for caches in session.pages.caches.values() for name in caches}
    ring = sum(t.nbytes for name, t in session.caches.items() if name not in held)
    after = session.pages.stats()["pools"]
    if any(p["in_use"] or p["reserved"] for p in after.values()):
        raise RuntimeError(f"pages still held or reserved after every request retired: {after}")
    return {
        "max_seq_len": max_seq_len, "slots": slots, "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt) for r in requests), "new_tokens": sum(len(s.tokens) for s in states),
        "pools": pools, "pages": pages,
        "allocated_bytes": sum(pages[name] * p.page_bytes for name, p in pools.items()),
        "contiguous_bytes": sum(slots * p.slot_bytes for p in pools.values()),
        "peak_bytes": sampler.peak_bytes, "peak_pages": sampler.peak_pages, "peak_tokens": sampler.peak_tokens,
        "exact_bytes": sampler.peak_tokens * sum(p.bytes_per_token for p in pools.values()),
        "ring_bytes": ring, "samples": sampler.samples, "page_waits": engine.stats.as_dict().get("page_waits"),
        "steps": engine.stats.as_dict().get("steps"),
    }


def serving_cases(r: dict) -> list[Measurement]:
    slots = r["slots"]
    params = {"max_seq_len": r["max_seq_len"], "slots": slots, "requests": r["requests"],
              "prompt_tokens": r["prompt_tokens"], "new_tokens": r["new_tokens"], "steps": r["steps"],
              "page_waits": r["page_waits"], "pages": r["pages"], "peak_pages": r["peak_pages"],
              "peak_tokens": r["peak_tokens"],
              "pages_per_slot": {name: p.pages_per_slot for name, p in r["pools"].items()},
              "page_bytes": {name: p.page_bytes for name, p in r["pools"].items()},
              "ring_bytes": r["ring_bytes"], "samples": r["samples"]}
    contiguous = f"contiguous, {slots} slots x {size_label(r['max_seq_len'])}"
    name = "paged_memory.serving"
    return [
        compare_counts(name, "allocated vs contiguous", r["contiguous_bytes"], r["allocated_bytes"], "bytes",
                       contiguous, "pools sized to the requests", dict(params)),
        compare_counts(name, "peak in use vs contiguous", r["contiguous_bytes"], r["peak_bytes"], "bytes",
                       contiguous, "peak in use", dict(params)),
        compare_counts(name, "peak in use vs allocated", r["allocated_bytes"], r["peak_bytes"], "bytes",
                       "pools sized to the requests", "peak in use", dict(params)),
        compare_counts(name, "peak in use vs tokens held", math.ceil(r["exact_bytes"]), r["peak_bytes"], "bytes",
                       f"{r['peak_tokens']} tokens x bytes/token", "peak in use",
                       {**params, "bytes_per_token": r["exact_bytes"] / max(r["peak_tokens"], 1)}),
    ]


@benchmark("paged_memory")
def paged_memory_benchmark(settings: Settings) -> list:
    specs = full_size_specs()
    print(byte_table(pool_bytes(specs), ring_bytes(specs), f"{FULL_RECIPE}: cache bytes per token held and per slot"))
    [package] = exported_variants((MAX_SEQ_LEN,), settings)
    result = serve(package, request_set(package.vocab_size))
    return serving_cases(result) + full_size_cases(specs)


# -- session_memory: resident memory of opening a session -----------------------------------------

ROOT = Path(__file__).resolve().parent.parent
MARK = "session_memory: "
MIB = 1 << 20
BUDGET_FRACTION = 0.05


def engine_requests() -> list[Request]:
    """The prompts and lengths of tests/runtime/serving/test_engine.py's 64 requests (seed 64)."""
    gen = torch.Generator().manual_seed(64)
    lengths = [1, 1, 129, 200] + torch.randint(1, 220, (REQUESTS - 4,), generator=gen).tolist()
    out = []
    for i, length in enumerate(lengths):
        prompt = torch.randint(0, 512, (length,), generator=gen).tolist()
        out.append(Request(prompt, int(torch.randint(1, 13, (1,), generator=gen)), id=i))
    return out


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _open(path: str, mode: str, slots: int) -> dict:
    """One child: open a session of `slots` in `mode`, report its memory; serve if "default"."""
    torch.set_num_threads(1)
    from b12x_toolchain.runtime import load
    from b12x_toolchain.runtime.session import memory

    package = load(path)
    pages = None
    if mode == "zero-filled":
        memory.LAZY_BYTES = math.inf  # every buffer torch.zeros, written at open
        pages = {name: slots * p.pages_per_slot for name, p in pool_bytes(package_cache_specs(package)).items()}
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the RSS now
    base = _status("VmRSS")
    fraction = None if mode in ("default", "zero-filled") else float(mode)
    session = package.session(slots=slots, pages=pages, memory_fraction=fraction)
    out = {"rss": _status("VmRSS") - base, "peak": _status("VmHWM") - base, "rss_after_load": base,
           "pools": {name: pool.count for name, pool in session.pools.items()},
           "page_bytes": {name: pool.page_bytes for name, pool in session.pools.items()},
           "pages_per_slot": {name: pool.pages_per_slot for name, pool in session.pools.items()},
           "memory_budget": session.memory_budget}
    if mode != "zero-filled":
        engine = Engine(session)
        states = engine.generate(engine_requests())
        out.update(tokens=[s.tokens for s in states], serving_peak=_status("VmHWM") - base,
                   page_waits=engine.stats.as_dict().get("page_waits"))
    return out


def child(path: Path, mode: str, slots: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.paged_memory", str(path), mode, str(slots)], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"session_memory {path.name} {mode}: child failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK):])


@benchmark("session_memory")
def session_memory_benchmark(settings: Settings) -> list:
    short, long = exported_variants((1 << 10, MAX_SEQ_LEN), settings)
    before = child(long.path, "zero-filled", SLOTS)
    after = child(long.path, "default", SLOTS)
    budget = child(long.path, str(BUDGET_FRACTION), SLOTS)
    reference = child(short.path, "default", 8)
    for run, what in ((after, "default pools"), (budget, f"memory_fraction {BUDGET_FRACTION}")):
        if run["tokens"] != reference["tokens"]:
            raise RuntimeError(f"the 1M session with {what} emitted other tokens than the 1k session")
    params = {key: after[key] for key in ("pools", "page_bytes", "pages_per_slot", "memory_budget", "page_waits")}
    params.update(before_pools=before["pools"], rss_after_load_mib=after["rss_after_load"] / MIB,
                  requests=REQUESTS, tokens=sum(map(len, after["tokens"])), identical_to_1k_8_slots=True)
    label = f"{SLOTS} slots, {size_label(MAX_SEQ_LEN)}"
    zero = "pools for every slot at max_seq_len, zero-filled at open"
    return [
        compare_counts("session_memory.rss", f"{label}: RSS after opening", before["rss"], after["rss"], "bytes",
                       zero, "default pools", dict(params)),
        compare_counts("session_memory.rss", f"{label}: peak RSS opening", before["peak"], after["peak"], "bytes",
                       zero, "default pools", dict(params)),
        compare_counts("session_memory.rss", f"{label}: peak RSS serving {REQUESTS} requests", before["peak"],
                       after["serving_peak"], "bytes", f"{zero} (opening alone)", "default pools, served",
                       dict(params)),
        compare_counts("session_memory.pages", f"{label}: pages of memory_fraction {BUDGET_FRACTION}",
                       sum(before["pools"].values()), sum(budget["pools"].values()), "pages",
                       "every slot at max_seq_len", f"what memory_fraction {BUDGET_FRACTION} holds",
                       {key: budget[key] for key in ("pools", "memory_budget", "page_waits", "rss", "serving_peak")}),
    ]


if __name__ == "__main__":  # one child process: python -m benchmarks.paged_memory PACKAGE MODE SLOTS
    print(MARK + json.dumps(_open(sys.argv[1], sys.argv[2], int(sys.argv[3]))), flush=True)
