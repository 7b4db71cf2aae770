"""`b12x` command line. Each command lives in its own module (exporter/cmd_*.py)."""

from __future__ import annotations

import click

from b12x_toolchain.exporter.cli.cmd_abi import abi
from b12x_toolchain.exporter.cli.cmd_compile import compile_package
from b12x_toolchain.exporter.cli.cmd_export import export
from b12x_toolchain.exporter.cli.cmd_inspect import inspect
from b12x_toolchain.exporter.cli.cmd_recipe import recipe
from b12x_toolchain.exporter.cli.cmd_run import run
from b12x_toolchain.exporter.cli.cmd_serve import serve
from b12x_toolchain.exporter.cli.cmd_train import train
from b12x_toolchain.exporter.cli.cmd_verify import verify


@click.group()
@click.version_option(package_name="b12x-toolchain")
def main():
    """Export speculative-decoding passes as versioned packages and replay them."""


for command in (export, inspect, compile_package, run, serve, abi, verify, recipe, train):
    main.add_command(command)


if __name__ == "__main__":
    main()
