"""How an engine is built: one set of options and one builder for every front end.

`b12x run`, `b12x serve` and a server embedding the loader API all describe their engine with
`EngineOptions` and get it from `open_engine`, so a default set here is the default
everywhere. The in-memory prefix tier is on by default (1 GiB): a repeated prompt, or the
shared head of a chat's turns, is restored from a snapshot instead of prefilled again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
COMPILE_ENV = "B12X_COMPILE"  # "0": no compiled replay unless asked for (options.compile=True)


def compile_default() -> bool:
    """Compiled replay is on unless the environment says B12X_COMPILE=0 (a machine without a
    compiler, or a test suite that opens hundreds of short-lived engines)."""
    return os.environ.get(COMPILE_ENV, "1") != "0"


@dataclass(frozen=True)
class EngineOptions:
    device: str = "cpu"
    slots: int | None = None  # default: the package's largest verify rows bucket
    pages: int | None = None  # per paged-cache pool; default: what the session's memory share holds
    cache_bytes: int | None = None  # instead of pages: the paged caches' byte budget
    speculative: bool = True  # draft and verify; otherwise one token per step
    adaptive: bool = True  # greedy rows decode without drafting while drafting does not pay (draft_policy.py)
    temperature: float = 0.0  # for requests that set none: 0 decodes greedily
    top_p: float = 1.0
    seed: int = 0
    prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES  # each tier's budget; 0: no prefix cache
    prefix_cache_dir: str | None = None  # the L2 tier's directory (snapshots survive restarts)
    # Replay through TorchInductor: the plain graphs serve while every bucket compiles in the
    # background, then all switch at once (session/background_compile.py); cached locally.
    compile: bool = field(default_factory=compile_default)
    capture: object = None  # how the session captures each bucket (session/capture.py); default by device

    def __post_init__(self):
        problems = check_options(self)
        if problems:
            raise ValueError("; ".join(problems))


FIELD_NAMES = {"pages": "pages", "cache_bytes": "cache_bytes", "greedy": "speculative=False",
               "temperature": "temperature", "prefix_cache_bytes": "prefix_cache_bytes"}


def check_options(options, names: dict = FIELD_NAMES) -> list[str]:
    """What is wrong with a combination of options, each naming the values; `names` spells the
    options as the caller knows them (the CLI: its flags)."""
    problems = []
    if options.pages is not None and options.cache_bytes is not None:
        problems.append(f"{names['pages']} ({options.pages}) and {names['cache_bytes']} ({options.cache_bytes}) "
                        "both size the paged caches; give one of them")
    if not options.speculative and options.temperature > 0:
        problems.append(f"{names['greedy']} decodes greedily; it cannot be combined with {names['temperature']} "
                        f"above 0 (got {options.temperature})")
    if options.prefix_cache_bytes < 0:
        problems.append(f"{names['prefix_cache_bytes']} must be >= 0, got {options.prefix_cache_bytes}")
    if options.prefix_cache_dir is not None and options.prefix_cache_bytes == 0:
        problems.append(f"a prefix cache directory ({options.prefix_cache_dir}) needs "
                        f"{names['prefix_cache_bytes']} above 0")
    return problems


def open_prefix_cache(package, options: EngineOptions, rank: int | None = None):
    """The prefix cache the options ask for (L1 in memory, L2 on disk with a directory), or None.
    rank: a rank of a parallel package, whose L2 is its own folder below the directory."""
    from b12x_toolchain.runtime.prefix.cache import PrefixCache

    if options.prefix_cache_bytes == 0:
        return None
    return PrefixCache(package, l1_bytes=options.prefix_cache_bytes,
                       l2_dir=rank_prefix_dir(options.prefix_cache_dir, rank), l2_bytes=options.prefix_cache_bytes)


def rank_prefix_dir(directory: str | None, rank: int | None) -> str | None:
    """Each rank of a parallel package keeps its own L2 directory below the one given (its own shard)."""
    if directory is None or rank is None:
        return directory
    return str(Path(directory) / f"rank-{rank}")


def open_session(package, options: EngineOptions, drafter=None, compile_here: bool = False):
    """The session `options` describe over a loaded package, with only the passes its engine replays.
    compile_here: compile every graph now, on this thread (`b12x compile`), not in the background."""
    from b12x_toolchain.runtime.serving.engine import passes_used

    slots = options.slots or package.passes["verify"].rows_buckets[-1]
    # The ranks of a parallel package replay in lockstep, and a switch to compiled graphs is not
    # yet one of the changes rank 0 sends them: they replay their plain graphs.
    compiled = options.compile and package.mapping is None
    return package.session(device=options.device, slots=slots, pages=options.pages, cache_bytes=options.cache_bytes,
                           compile=compiled, compile_in_background="here" if compile_here else True,
                           capture=options.capture,
                           passes=passes_used(package.passes, options.speculative, drafter, options.adaptive))


def open_engine(package, options: EngineOptions, prefix_cache=None, drafter=None, channel=None):
    """The session and engine `options` describe over a loaded package. The caller owns
    `prefix_cache` (open_prefix_cache), which outlives the engine and is closed by the caller.
    channel: rank 0's ControlChannel to the other ranks of a parallel package, which follow
    this engine's every change to its session (runtime/parallel/lockstep.py)."""
    from b12x_toolchain.runtime.serving.engine import Engine

    session = open_session(package, options, drafter)
    if channel is not None:
        from b12x_toolchain.runtime.parallel.lockstep import LeaderSession
        from b12x_toolchain.runtime.parallel.lockstep_prefix import LeaderPrefixCache

        session = LeaderSession(session, channel)
        session.check_pages()
        prefix_cache = LeaderPrefixCache(prefix_cache, session) if prefix_cache is not None else None
    return Engine(session, speculative=options.speculative, adaptive=options.adaptive,
                  temperature=options.temperature, top_p=options.top_p,
                  seed=options.seed, drafter=drafter, prefix_cache=prefix_cache)
