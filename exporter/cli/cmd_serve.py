"""`b12x serve`: a package behind the OpenAI API (runtime/serving/http), with Prometheus metrics."""

from __future__ import annotations

import click

from b12x_toolchain.exporter.cli.common import fail


@click.command()
@click.argument("package", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; the default answers this machine only.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(min=0, max=65535))
@click.option("--model-name", help="The model id clients send and /v1/models lists [default: the package's name].")
@click.option("--api-key", envvar="B12X_API_KEY", show_envvar=True,
              help="Require `Authorization: Bearer KEY` on every route but /health.")
@click.option("--slots", type=click.IntRange(min=1),
              help="Requests decoded together [default: the package's largest verify rows bucket].")
@click.option("--pages", type=click.IntRange(min=1), help="Pages of each paged-cache pool.")
@click.option("--cache-bytes", type=click.IntRange(min=1),
              help="Byte budget of the paged caches, split so every pool holds the same tokens (instead of --pages).")
@click.option("--greedy", is_flag=True, help="Plain decoding, one token per step, instead of speculative decoding.")
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Temperature of requests that send none (0: greedy).")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(min=0, max=1, min_open=True),
              help="Nucleus sampling mass of requests that send none.")
@click.option("--seed", default=0, show_default=True, type=int, help="Sampling seed of requests that send none.")
@click.option("--prefix-cache-dir", type=click.Path(file_okay=False),
              help="Keep prompt snapshots here (L2, survives restarts) and in memory (L1).")
@click.option("--prefix-cache-bytes", type=click.IntRange(min=1),
              help="Byte budget of each prefix-cache tier (default 1 GiB); alone, enables the in-memory tier.")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait for a slot; more are answered 503 with Retry-After.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(min=1),
              help="Largest request body; larger ones are answered 413.")
@click.option("--grace-seconds", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="On SIGTERM: how long running requests may take to finish before they are cancelled.")
@click.option("--device", default="cpu", show_default=True,
              help="torch device of the session: cpu, cuda (the current CUDA device) or cuda:N; one torch "
                   "cannot use is refused before the server listens.")
@click.option("--threads", type=click.IntRange(min=1), help="torch intra-op threads [default: torch's choice].")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def serve(package, host, port, model_name, api_key, slots, pages, cache_bytes, greedy, temperature, top_p, seed,
          prefix_cache_dir, prefix_cache_bytes, max_queue, max_body_bytes, grace_seconds, device, threads, log_level):
    """Serve a package over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models,
    /health and /metrics (Prometheus). One engine serves every connection; SIGTERM drains."""
    from b12x_toolchain.runtime import PackageError
    from b12x_toolchain.runtime.serving.http.server import Server
    from b12x_toolchain.runtime.serving.http.service import ServeOptions, Service

    if pages is not None and cache_bytes is not None:
        raise click.UsageError("--pages and --cache-bytes both size the paged caches; give one of them")
    if greedy and temperature > 0:
        raise click.UsageError("--greedy decodes greedily; it cannot be combined with --temperature above 0")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    options = ServeOptions(package, model_name=model_name, device=device, slots=slots, pages=pages,
                           cache_bytes=cache_bytes, speculative=not greedy, temperature=temperature, top_p=top_p,
                           seed=seed, prefix_cache_dir=prefix_cache_dir, prefix_cache_bytes=prefix_cache_bytes,
                           max_queue=max_queue, api_key=api_key or None, max_body_bytes=max_body_bytes)
    try:
        service = Service(options)
    except (PackageError, ValueError, OSError, RuntimeError) as exc:  # RuntimeError: torch's, preparing the session
        fail(str(exc))
    try:
        server = Server(service, host, port, grace_seconds, log_level)
    except OSError as exc:
        service.close()
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    click.echo(f"b12x serve: {service.model_name} at {server.url}/v1 (slots {service.session.slots}, "
               f"{'speculative' if not greedy else 'plain'} decoding)", err=True)
    server.run()
