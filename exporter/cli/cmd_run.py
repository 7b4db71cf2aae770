"""`b12x run`: serve one or more prompts from a package (on CPU, or --device) and report how it went."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from b12x_toolchain.exporter.cli import ranks
from b12x_toolchain.exporter.cli.common import fail
from b12x_toolchain.exporter.cli.engine_flags import engine_flags, engine_options
from b12x_toolchain.exporter.cli.run_requests import (
    Defaults,
    PromptError,
    encode_texts,
    from_ids,
    from_text,
    parse_ids,
    read_prompt_file,
)

STEP_COLUMNS = ("step", "rows", "padding_rows", "drafted", "accepted", "bonus", "admitted", "retired", "slot_reuse",
                "page_waits")


def _requests(prompts, prompt_ids, prompt_files, defaults: Defaults) -> list:
    items = [from_text(text, f"--prompt #{i + 1}", defaults) for i, text in enumerate(prompts)]
    items += [from_ids(text, f"--prompt-ids #{i + 1}", defaults) for i, text in enumerate(prompt_ids)]
    for path in prompt_files:
        items += read_prompt_file(Path(path), defaults)
    return items


def _pages_table(stats: dict) -> Table:
    """Per page pool: pages, in use (by slots or snapshots), free, shared, copied, evicted."""
    columns = ("pages", "in_use", "free", "shared", "allocated", "copied", "evicted")
    table = Table(title="pages")
    table.add_column("pool")
    for column in columns:
        table.add_column(column.replace("_", " "), justify="right")
    for pool, counts in stats["pools"].items():
        table.add_row(pool, *(str(counts[c]) for c in columns))
    return table


def _stats_table(stats: dict, title: str) -> Table:
    table = Table(title=title)
    table.add_column("stat")
    table.add_column("value", justify="right")
    for key, value in stats.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    return table


def _requests_table(states) -> Table:
    table = Table(title="requests")
    for name in ("id", "slot", "prompt", "new", "finish", "steps", "accepted", "first ms", "latency ms"):
        table.add_column(name, justify="left" if name in ("id", "finish") else "right")
    for s in states:
        table.add_row(str(s.id), str(s.slot), str(len(s.prompt)), str(len(s.tokens)), s.finish_reason, str(s.steps),
                      str(s.accepted), f"{s.first_token_s * 1e3:.1f}", f"{s.latency_s * 1e3:.1f}")
    return table


def _steps_table(steps: list) -> Table:
    table = Table(title="steps")
    for name in STEP_COLUMNS:
        table.add_column(name, justify="right")
    for step in steps:
        table.add_row(*(str(getattr(step, name)) for name in STEP_COLUMNS))
    return table


@click.command()
@click.argument("package", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", "prompts", multiple=True,
              help="A prompt as text, encoded with the package's tokenizer; repeat for more prompts.")
@click.option("--prompt-ids", multiple=True, help="A prompt's token ids, comma or space separated; repeat for more prompts.")
@click.option("--prompts", "prompt_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A file with one prompt per line: token ids, or JSON (a list of ids, or an object with "
                   "prompt (ids or text), max_new_tokens, stop, id, seed). Repeatable.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1),
              help="New tokens per request, unless its JSON line sets its own.")
@click.option("--stop", "stop_ids", multiple=True,
              help="Stop token ids (comma separated, repeatable) for requests that set none of their own "
                   "[default: the tokenizer's end of text, when the package has a tokenizer].")
@engine_flags
@click.option("--show-steps", is_flag=True, help="Also print every step's statistics.")
@click.option("--show-ids", is_flag=True, help="Also print the generated token ids when the package has a tokenizer.")
@ranks.rank_flags
def run(package, prompts, prompt_ids, prompt_files, max_new_tokens, stop_ids, show_steps, show_ids, **flags):
    """Serve prompts from a package on CPU (or --device): many requests over reused slots, with a final report.
    A parallel package runs one process per rank (--nproc, through torchrun); rank 0 reports."""
    if not prompts and not prompt_ids and not prompt_files:
        raise click.UsageError("give at least one prompt: --prompt, --prompt-ids or --prompts")
    options = engine_options(flags)
    try:
        stop = tuple(t for text in stop_ids for t in parse_ids(text))
        items = _requests(prompts, prompt_ids, prompt_files, Defaults(max_new_tokens, stop))
    except PromptError as exc:
        raise click.BadParameter(str(exc)) from None
    ranks.launch_if_asked(package, flags, stream=False)  # a launcher that imports no torch
    from b12x_toolchain.runtime.errors import PackageError
    from b12x_toolchain.runtime.parallel.control import RankLost
    from b12x_toolchain.runtime.session.validate import InputError

    try:
        outcome = _serve(package, items, options, flags)
    except (PackageError, InputError, ValueError, OSError, RankLost) as exc:
        fail(str(exc))
    if outcome is not None:  # rank 0, or the only process, reports
        _report(outcome, options, show_steps, show_ids)


@dataclass
class _Outcome:
    engine: object
    states: list
    steps: list
    codec: object
    wall: float
    cache_stats: dict | None


def _serve(package, items, options, flags) -> _Outcome | None:
    """Load the package (this rank's, in its group), build the engine from `options` and decode
    every request, with a progress bar. A rank other than 0 follows rank 0's engine instead
    and returns nothing."""
    from b12x_toolchain.runtime import load

    if ranks.launched_rank() is None:
        return _decode(load(package), package, items, options)
    rank, channel = ranks.open_rank(flags, options.device)
    if rank != 0:
        ranks.run_worker(package, options, channel, flags["join_timeout"])
    try:
        return _decode(load(package, rank=rank, peer_timeout=flags["join_timeout"]), package, items, options, channel)
    finally:
        ranks.leave_group()


def _decode(loaded, package, items, options, channel=None) -> _Outcome:
    from b12x_toolchain.runtime.parallel.lockstep import stop_followers
    from b12x_toolchain.runtime.serving.options import open_engine, open_prefix_cache
    from b12x_toolchain.runtime.serving.requests import check_request

    cache = None
    try:
        codec = loaded.tokenizer
        items = encode_texts(items, codec, package)
        model = loaded.manifest.model
        for request, origin in items:  # before any replay, naming the line to fix
            check_request(request, origin if request.id is None else f"{request.id!r} ({origin})",
                          model.vocab_size, model.max_seq_len)
        cache = open_prefix_cache(loaded, options, None if channel is None else channel.rank)
        engine = open_engine(loaded, options, cache, channel=channel)
        states = engine.submit([request for request, _ in items])
        started = time.perf_counter()
        steps = _decode_with_progress(engine, states)
        wall = time.perf_counter() - started
        cache_stats = cache.stats_dict() if cache is not None else None
    finally:
        if channel is not None:  # first: the L2 writes below may take longer than a step deadline
            stop_followers(channel)
        if cache is not None:
            cache.close()  # waits for queued snapshots to reach the directory
    return _Outcome(engine, states, steps, codec, wall, cache_stats)


def _decode_with_progress(engine, states) -> list:
    """Run the engine to completion; a bar counts tokens against every request's max_new_tokens
    (a stop token ends a request early). Returns every step's StepStats."""
    steps = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"0/{len(states)} requests", total=sum(s.max_new_tokens for s in states))

        def on_step(step) -> None:
            steps.append(step)
            done = sum(s.max_new_tokens if s.done else len(s.tokens) for s in states)
            progress.update(task, completed=done, description=f"{len(engine.finished)}/{len(states)} requests")

        engine.run(on_step)
    return steps


def _report(outcome: _Outcome, options, show_steps: bool, show_ids: bool) -> None:
    codec, engine, wall = outcome.codec, outcome.engine, outcome.wall
    for state in outcome.states:
        if codec is None or show_ids:
            click.echo(f"request {state.id} tokens: " + " ".join(map(str, state.tokens)))
        if codec is not None:  # the stop token ended the request; it is not part of the text
            shown = state.tokens[:-1] if state.finish_reason == "stop" else state.tokens
            click.echo(f"request {state.id} text: {codec.decode(shown)}")
    # Piped output would otherwise be cut at 80 columns, squeezing the tables' headers.
    console = Console(width=None if sys.stdout.isatty() else 160)
    if show_steps:
        console.print(_steps_table(outcome.steps))
    mode = "plain greedy decoding" if not options.speculative else \
        "speculative " + ("sampling" if options.temperature > 0 else "decoding")
    report = engine.stats.as_dict() | {"requests": len(outcome.states), "wall_seconds": wall,
                                       "wall_tokens_per_second": engine.stats.generated / wall if wall else 0.0}
    if outcome.cache_stats is not None:
        report |= {f"prefix {k}": v for k, v in outcome.cache_stats.items()
                   if k in ("exact_hits", "prefix_hits", "misses", "prefill_tokens_saved")}
    console.print(_stats_table(report, mode))
    console.print(_pages_table(engine.session.pages.stats()))
    console.print(_requests_table(outcome.states))
    compiler = getattr(engine.session, "compiler", None)
    if compiler is not None:
        click.echo(_compile_line(compiler.status()), err=True)


def _compile_line(status: dict) -> str:
    """What replayed this run: compiled graphs, or plain ones while the compilation went on (kept for the next run)."""
    if status["state"] == "compiled":
        return f"replay: compiled ({status['buckets']} pass graphs)"
    if status["state"] == "failed":
        return f"replay: plain; compilation failed: {status['error'].splitlines()[0]}"
    return (f"replay: plain while {status['compiled']} of {status['buckets']} pass graphs compiled in the background "
            "(kept: a later run picks up from there; `b12x compile` finishes them)")
