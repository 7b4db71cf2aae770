"""The engine's flags, one set for `b12x run` and `b12x serve`: same names, same defaults, same
checks, turned into the EngineOptions (runtime/serving/options.py) the loader API takes too."""

from __future__ import annotations

from types import SimpleNamespace

import click

from b12x_toolchain.exporter.cli.ranks import launches_ranks
from b12x_toolchain.runtime.serving.options import (
    DEFAULT_PREFIX_CACHE_BYTES,
    EngineOptions,
    check_options,
    compile_default,
)

FLAG_NAMES = {"pages": "--pages", "cache_bytes": "--cache-bytes", "greedy": "--greedy",
              "temperature": "--temperature", "prefix_cache_bytes": "--prefix-cache-bytes"}

ENGINE_FLAGS = (
    click.option("--device", default="cpu", show_default=True,
                 help="torch device of the session: cpu, cuda (the current CUDA device) or cuda:N; one torch "
                      "cannot use is refused before anything runs."),
    click.option("--slots", type=click.IntRange(min=1),
                 help="Requests decoded together [default: the package's largest verify rows bucket]."),
    click.option("--pages", type=click.IntRange(min=1),
                 help="Pages of each paged-cache pool [default: what the device's memory share holds, at most "
                      "every slot at max_seq_len]; requests wait for pages, one that could never fit is refused."),
    click.option("--cache-bytes", type=click.IntRange(min=1),
                 help="Byte budget of the paged caches, split so every pool holds the same tokens (instead of "
                      "--pages)."),
    click.option("--greedy", is_flag=True,
                 help="Plain greedy decoding, one token per step, instead of speculative decoding."),
    click.option("--always-draft", is_flag=True,
                 help="Draft for every greedy request every step, even while its drafts are not accepted often "
                      "enough to pay for verifying them [default: such a request decodes one token a step and "
                      "tries drafting again later]."),
    click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0),
                 help="Temperature of requests that set none: 0 decodes greedily; above 0 samples (speculative "
                      "sampling keeps the target's distribution)."),
    click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(min=0, max=1, min_open=True),
                 help="Nucleus sampling mass of requests that set none."),
    click.option("--seed", default=0, show_default=True, type=int, help="Sampling seed of requests that set none."),
    click.option("--prefix-cache-bytes", default=DEFAULT_PREFIX_CACHE_BYTES, show_default=True,
                 type=click.IntRange(min=0),
                 help="Byte budget of each prefix-cache tier; a repeated prompt prefix is restored from a "
                      "snapshot instead of prefilled. 0 turns the prefix cache off."),
    click.option("--prefix-cache-dir", type=click.Path(file_okay=False),
                 help="Also keep prompt snapshots in this directory (L2, survives restarts)."),
    click.option("--compile/--no-compile", "compiled", default=None,
                 help="Replay through TorchInductor: requests are answered at once on the plain graphs while "
                      "every pass graph compiles in the background (minutes on a CPU), then all switch between "
                      "requests; cached on this machine (keyed by package, device, torch and shapes), so a "
                      "restart or `b12x compile` beforehand makes it compiled from the first request "
                      "[default: on; B12X_COMPILE=0 makes it off]."),
    click.option("--threads", type=click.IntRange(min=1),
                 help="torch intra-op threads [default: torch's choice]; 1 is often fastest on a busy machine."),
)


def engine_flags(command):
    """Decorate a click command with the engine's flags; its function takes them as **flags, for engine_options."""
    for flag in reversed(ENGINE_FLAGS):
        command = flag(command)
    return command


def engine_options(flags: dict) -> EngineOptions:
    """The EngineOptions of the flags' values; a combination that cannot work is a usage error,
    before anything loads. Sets torch's thread count when --threads is given, except in a
    command that only launches ranks (--nproc): each rank sets its own, and the launcher
    imports no torch."""
    options = dict(device=flags["device"], slots=flags["slots"], pages=flags["pages"],
                   cache_bytes=flags["cache_bytes"], speculative=not flags["greedy"],
                   adaptive=not flags["always_draft"],
                   temperature=flags["temperature"], top_p=flags["top_p"], seed=flags["seed"],
                   prefix_cache_bytes=flags["prefix_cache_bytes"], prefix_cache_dir=flags["prefix_cache_dir"],
                   compile=compile_default() if flags["compiled"] is None else flags["compiled"])
    problems = check_options(SimpleNamespace(**options), FLAG_NAMES)  # said as flags, before EngineOptions says it
    if problems:
        raise click.UsageError("; ".join(problems))
    built = EngineOptions(**options)
    if flags["threads"] is not None and not launches_ranks(flags):
        import torch

        torch.set_num_threads(flags["threads"])
    return built
