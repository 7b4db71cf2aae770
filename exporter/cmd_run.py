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
def run(package, prompt_ids, max_new_tokens, greedy):
    """Prefill a prompt and generate tokens on CPU."""
    from b12x.runtime import PackageError, load
    from b12x.runtime.speculative import Decoder
    from b12x.runtime.validate import InputError

    prompt = _parse_ids(prompt_ids)
    try:
        session = load(package).session(device="cpu", slots=1)
        decoder = Decoder(session)
        tokens = decoder.generate([prompt], max_new_tokens, speculative=not greedy)[0]
    except (PackageError, InputError, ValueError) as exc:
        fail(str(exc))
    click.echo("tokens: " + " ".join(map(str, tokens)))
    stats = Table(title="speculative decoding" if not greedy else "greedy decoding")
    stats.add_column("stat")
    stats.add_column("value", justify="right")
    for key, value in decoder.stats.as_dict().items():
        stats.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(stats)
