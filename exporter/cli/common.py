"""What every `b12x` command shares: the console and how errors are reported."""

from __future__ import annotations

import sys

import click
from rich.console import Console

console = Console()


def fail(message: str) -> None:
    # Plain echo, not rich: an error line must not be wrapped, so tools can grep file:line.
    click.echo(f"error: {message}", err=True)
    sys.exit(1)
