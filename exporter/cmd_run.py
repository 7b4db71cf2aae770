"""`b12x run`: prefill and generate from a package on CPU."""

from __future__ import annotations

import click
from rich.table import Table

from b12x.exporter.cli_common import console, fail


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of integer token ids") from None


@click.command()
@click.argument("package", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt-ids", required=True, help="Prompt token ids, comma or space separated.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--greedy", is_flag=True, help="Plain greedy decoding instead of speculative decoding.")
@click.option("--prefix-cache-dir", type=click.Path(file_okay=False),
              help="Keep prompt snapshots here (L2, survives restarts) and in memory (L1); a later run "
                   "with the same prompt prefix skips prefilling it.")
@click.option("--prefix-cache-bytes", type=click.IntRange(min=0),
              help="Byte budget of each prefix-cache tier (default 1 GiB); alone, enables the in-memory tier.")
def run(package, prompt_ids, max_new_tokens, greedy, prefix_cache_dir, prefix_cache_bytes):
    """Prefill a prompt and generate tokens on CPU."""
    from b12x.runtime import PackageError, load
    from b12x.runtime.prefix_cache import PrefixCache
    from b12x.runtime.speculative import Decoder
    from b12x.runtime.validate import InputError

    prompt = _parse_ids(prompt_ids)
    cache = None
    try:
        loaded = load(package)
        if prefix_cache_dir is not None or prefix_cache_bytes is not None:
            budget = (1 << 30) if prefix_cache_bytes is None else prefix_cache_bytes
            cache = PrefixCache(loaded, l1_bytes=budget, l2_dir=prefix_cache_dir, l2_bytes=budget)
        session = loaded.session(device="cpu", slots=1)
        decoder = Decoder(session, prefix_cache=cache)
        tokens = decoder.generate([prompt], max_new_tokens, speculative=not greedy)[0]
    except (PackageError, InputError, ValueError, OSError) as exc:
        fail(str(exc))
    finally:
        if cache is not None:
            cache.close()  # waits for the snapshot to reach the directory
    click.echo("tokens: " + " ".join(map(str, tokens)))
    stats = Table(title="speculative decoding" if not greedy else "greedy decoding")
    stats.add_column("stat")
    stats.add_column("value", justify="right")
    prefix = {} if cache is None else {f"prefix {k}": v for k, v in cache.stats_dict().items()
                                       if k in ("exact_hits", "prefix_hits", "misses", "prefill_tokens_saved")}
    for key, value in {**decoder.stats.as_dict(), **prefix}.items():
        stats.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(stats)
