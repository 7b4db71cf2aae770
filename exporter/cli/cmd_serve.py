"""`b12x serve`: a package behind the OpenAI API (runtime/serving/http), with Prometheus metrics."""

from __future__ import annotations

import click

from b12x_toolchain.exporter.cli import ranks
from b12x_toolchain.exporter.cli.common import fail
from b12x_toolchain.exporter.cli.engine_flags import engine_flags, engine_options


@click.command()
@click.argument("package", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; the default answers this machine only.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(min=0, max=65535))
@click.option("--model-name", help="The model id clients send and /v1/models lists [default: the package's name].")
@click.option("--api-key", envvar="B12X_API_KEY", show_envvar=True,
              help="Require `Authorization: Bearer KEY` on every route but /health.")
@engine_flags
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait for a slot; more are answered 503 with Retry-After.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(min=1),
              help="Largest request body; larger ones are answered 413.")
@click.option("--grace-seconds", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM: how long running requests may take to finish before they are cancelled.")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
@ranks.rank_flags
def serve(package, host, port, model_name, api_key, max_queue, max_body_bytes, grace_seconds, log_level, **flags):
    """Serve a package over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models,
    /health and /metrics (Prometheus). One engine serves every connection; SIGTERM drains. A
    parallel package runs one process per rank (--nproc): rank 0 serves HTTP and decides every
    step, the other ranks follow it."""
    from b12x_toolchain.runtime.serving.http.service import ServeOptions

    options = ServeOptions(package, engine_options(flags), model_name=model_name, max_queue=max_queue,
                           api_key=api_key or None, max_body_bytes=max_body_bytes)
    ranks.launch_if_asked(package, flags, stream=True)
    context = None
    if ranks.launched_rank() is not None:
        rank, channel = ranks.open_rank(flags, options.engine.device)
        if rank != 0:
            ranks.run_worker(package, options.engine, channel, flags["join_timeout"])
        from b12x_toolchain.runtime.serving.ranks import RankContext

        context = RankContext(rank, channel, flags["join_timeout"])
    _serve(options, context, host, port, grace_seconds, log_level)


def _serve(options, context, host, port, grace_seconds, log_level) -> None:
    from b12x_toolchain.runtime import PackageError
    from b12x_toolchain.runtime.parallel.lockstep import stop_followers
    from b12x_toolchain.runtime.serving.http.server import Server
    from b12x_toolchain.runtime.serving.http.service import Service

    try:
        service = Service(options, context)
    except (PackageError, ValueError, OSError, RuntimeError) as exc:  # RuntimeError: torch's, preparing the session
        if context is not None:
            stop_followers(context.channel)
        fail(str(exc))
    try:
        server = Server(service, host, port, grace_seconds, log_level)
    except OSError as exc:
        service.close()
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    world = "" if context is None else f", world size {context.channel.world_size}"
    click.echo(f"b12x serve: {service.model_name} at {server.url}/v1 (slots {service.session.slots}, "
               f"{'speculative' if options.engine.speculative else 'plain'} decoding{world})", err=True)
    server.run()
    if service.loop.failure is not None:
        fail(f"the engine failed: {service.loop.failure}")
