"""`b12x compile`: fill this machine's compile cache for a package ahead of time, so that `b12x
serve` and `b12x run` with the same engine flags replay compiled from their first request."""

from __future__ import annotations

import time

import click

from b12x_toolchain.exporter.cli.common import fail
from b12x_toolchain.exporter.cli.engine_flags import engine_flags, engine_options


@click.command(name="compile")
@click.argument("package", type=click.Path(exists=True, file_okay=False))
@engine_flags
def compile_package(package, **flags):
    """Compile every pass graph a server of PACKAGE replays, with the same engine flags (the
    graphs' shapes follow --slots, --pages and --device, the passes --greedy), into the local
    compile cache; nothing is written into the package. Run it after export, in CI or before a
    server starts; a cache that already holds them is only checked."""
    from dataclasses import replace

    from b12x_toolchain.runtime import PackageError, load
    from b12x_toolchain.runtime.serving.options import open_session

    options = replace(engine_options(flags), compile=True)
    start = time.perf_counter()
    try:  # every graph compiled (or read back from the cache) as the session opens, on this thread
        session = open_session(load(package), options, compile_here=True)
    except (PackageError, ValueError, OSError, RuntimeError) as exc:
        fail(str(exc))
    if session.compiler is None:  # a parallel package: its ranks replay their plain graphs (serving/options.py)
        fail(f"{package}: a parallel package's ranks do not replay compiled graphs; nothing to compile")
    status = session.compiler.status()
    if status["state"] == "failed":
        fail(f"compilation failed: {status['error']}")
    click.echo(f"{status['buckets']} pass graphs compiled in {time.perf_counter() - start:.0f} s; cached in "
               f"{session.compile_cache}")
