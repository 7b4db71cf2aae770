"""`b12x run --nproc N`: one process per rank, launched by torchrun, each loading its rank.

The command checks what it can before starting anything (the package's world size against
N x nnodes), then runs `python -m torch.distributed.run` with the same command line; each
rank finds itself launched (torchrun sets RANK and WORLD_SIZE), initialises the default
group (gloo on CPU) and loads the package as its rank, and only rank 0 reports. Every
rank runs the same engine and samples from the same logits, so their tokens agree
without a broadcast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import click

from b12x_toolchain.exporter.cli.common import fail

# Passed through to torchrun, when given, for multi-node launches.
RENDEZVOUS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr", "master_port")
PEER_TIMEOUT = 120.0  # seconds every rank waits for the others at load
ARGS = "B12X_RANK_ARGS"  # the command line each rank runs, as a JSON list


def launched_rank() -> int | None:
    """This process's rank when torchrun started it, else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def check_world(package: str, nproc: int, nnodes: int) -> None:
    """Refuse, before launching, a world the package was not exported for."""
    from b12x_toolchain.runtime import PackageError
    from b12x_toolchain.runtime.package.reader import read_manifest

    try:
        parallel = read_manifest(package).parallel
    except PackageError as exc:
        fail(str(exc))
    world = nproc * nnodes
    exported = 1 if parallel is None else parallel.world_size
    if world != exported:
        what = "one device" if parallel is None else parallel.describe()
        fail(f"--nproc {nproc} x --nnodes {nnodes} makes world size {world}; {package} was exported for {what}")


def launch(nproc: int, options: dict) -> None:
    """Run this very command once per rank through torchrun, and exit with its status.

    The ranks' error output is collected: on failure only the ranks' own `error:` lines are
    shown (once each), not torchrun's report of the failed child with its traceback."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    for key in RENDEZVOUS:
        if options.get(key) is not None:
            command.append(f"--{key.replace('_', '-')}={options[key]}")
    # The command line travels in the environment: torchrun's own parser would take options of
    # ours that abbreviate its own (--nproc) even after the module name.
    command += ["-m", "b12x_toolchain.exporter.cli.rank_main"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{ARGS: json.dumps(sys.argv[1:])})
    done = subprocess.run(command, env=env, stderr=subprocess.PIPE, text=True)
    if done.returncode == 0:
        sys.stderr.write(done.stderr)
        sys.exit(0)
    errors = list(dict.fromkeys(line for line in done.stderr.splitlines() if line.startswith("error: ")))
    for line in errors or [f"error: a rank failed (torchrun exit status {done.returncode}):"]:
        click.echo(line, err=True)
    if not errors:
        click.echo("\n".join(done.stderr.splitlines()[-20:]), err=True)
    sys.exit(1)


def join_group() -> int:
    """Initialise this rank's default group from torchrun's environment; returns the rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=PEER_TIMEOUT))  # `b12x run` serves on CPU
    return dist.get_rank()


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()

