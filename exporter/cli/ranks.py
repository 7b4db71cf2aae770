"""`b12x run --nproc N` and `b12x serve --nproc N`: one process per rank, launched by torchrun.

The command checks what it can before starting anything (the package's world size against
N x nnodes), then runs `python -m torch.distributed.run` with the same command line; each
rank finds itself launched (torchrun sets RANK and WORLD_SIZE), joins the default group
(gloo on CPU; NCCL for CUDA tensors, on the local rank's device) and a control group of its
own, and loads the package as its rank. Rank 0 runs the engine; every other rank runs the
worker loop (runtime/serving/ranks.py), making each change rank 0 sends. So only rank 0
samples, schedules or reports, and nodes other than the first start no server.

Failure ends the group: a rank that dies or does not answer within the step deadline
makes every other rank fail within it, each exits non-zero, and torchrun stops the rest.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import click

from b12x_toolchain.exporter.cli.common import fail
from b12x_toolchain.runtime.serving.ranks import DEFAULT_JOIN_TIMEOUT_S, DEFAULT_STEP_DEADLINE_S

# Passed through to torchrun, when given, for multi-node launches.
RENDEZVOUS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr", "master_port")
ARGS = "B12X_RANK_ARGS"  # the command line each rank runs, as a JSON list
# torchrun's own log lines (glog style: "W1206 18:20:00.123 ...") and its report once a rank failed.
TORCHRUN_LOG = re.compile(r"^\[?[DIWEF]\d{4} \d\d:\d\d:\d\d")

RANK_FLAGS = (
    click.option("--nproc", type=click.IntRange(min=1),
                 help="Processes (ranks) on this machine for a parallel package, launched through torchrun; "
                      "with --nnodes, the world size the package was exported for."),
    click.option("--nnodes", default=1, show_default=True, type=click.IntRange(min=1), help="Nodes (torchrun)."),
    click.option("--node-rank", type=click.IntRange(min=0), help="This node's rank (torchrun)."),
    click.option("--rdzv-backend", help="Rendezvous backend (torchrun)."),
    click.option("--rdzv-endpoint", help="Rendezvous endpoint host:port (torchrun)."),
    click.option("--rdzv-id", help="Rendezvous id shared by every node of the job (torchrun)."),
    click.option("--master-addr", help="Address of rank 0's node (torchrun, static rendezvous)."),
    click.option("--master-port", type=click.IntRange(min=1, max=65535), help="Port on rank 0's node (torchrun)."),
    click.option("--join-timeout", default=DEFAULT_JOIN_TIMEOUT_S, show_default=True,
                 type=click.FloatRange(min=1), help="Seconds every rank (and node) may take to start and load."),
    click.option("--step-deadline", default=DEFAULT_STEP_DEADLINE_S, show_default=True,
                 type=click.FloatRange(min=0.5),
                 help="Seconds a rank may take to answer a step; one that takes longer is lost and every "
                      "rank stops."),
)


def rank_flags(command):
    """Decorate a click command with the rank flags; its function takes them as keyword arguments."""
    for flag in reversed(RANK_FLAGS):
        command = flag(command)
    return command


def launched_rank() -> int | None:
    """This process's rank when torchrun started it, else None."""
    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def check_world(package: str, nproc: int, nnodes: int) -> None:
    """Refuse, before launching, a world the package was not exported for.

    The world size is read from manifest.json as strict JSON whose digest holds, so the
    launcher imports no torch (seconds of its start, on every node); every rank checks the
    whole package as it loads. Only a size that differs, or a manifest that cannot be read so,
    is checked here in full, to say what the package is (or what is wrong with it)."""
    if _declared_world(package) == nproc * nnodes:
        return
    from b12x_toolchain.runtime.errors import PackageError
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


def _declared_world(package: str) -> int | None:
    """The world size manifest.json states (1 without a parallel section), or None when it
    cannot be read as such or its digest does not match (an edited manifest is then refused
    by the full check, once, rather than by every rank)."""
    from b12x_toolchain.runtime import strict_json
    from b12x_toolchain.runtime.package.manifest_digest import digest_holds

    try:
        data = strict_json.loads((Path(package) / "manifest.json").read_bytes())
        parallel = data.get("parallel")
        world = 1 if parallel is None else parallel["world_size"]
        if not digest_holds(data):
            return None
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return None
    return world if type(world) is int else None


def launches_ranks(flags: dict) -> bool:
    """Whether this process is the command a user ran with --nproc (not one of its ranks)."""
    return flags.get("nproc") is not None and launched_rank() is None


def launch_if_asked(package: str, flags: dict, stream: bool) -> None:
    """In the command a user ran with --nproc: check the world, run every rank, exit with their status."""
    if not launches_ranks(flags):
        return
    check_world(package, flags["nproc"], flags["nnodes"])
    launch(flags, stream)


def _torchrun_command(flags: dict) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={flags['nproc']}"]
    for key in RENDEZVOUS:
        if flags.get(key) is not None:
            command.append(f"--{key.replace('_', '-')}={flags[key]}")
    if flags["nnodes"] > 1:  # how long this node's agent waits for the other nodes
        command.append(f"--rdzv-conf=timeout={int(flags['join_timeout'])},join_timeout={int(flags['join_timeout'])}")
    # The command line travels in the environment: torchrun's own parser would take options of
    # ours that abbreviate its own (--nproc) even after the module name.
    return command + ["-m", "b12x_toolchain.exporter.cli.rank_main"]


def launch(flags: dict, stream: bool) -> None:
    """Run this very command once per rank through torchrun, and exit with its status.

    The ranks' output passes through, but not torchrun's own log or its report (with a
    traceback) of what failed: on failure the ranks' `error:` lines are shown, once each.
    stream: pass the ranks' output on as it comes (a server's log), else once they end."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{ARGS: json.dumps(sys.argv[1:])})
    child = subprocess.Popen(_torchrun_command(flags), env=env, stderr=subprocess.PIPE, text=True)
    for sig in (signal.SIGTERM, signal.SIGINT):  # a supervisor's stop reaches rank 0, which drains
        signal.signal(sig, lambda number, frame: child.send_signal(number))
    errors, shown, hidden = [], [], []
    for line in child.stderr:
        line = line.rstrip("\n")
        if line.startswith("error: "):
            if line not in errors:
                errors.append(line)
                click.echo(line, err=True)
        elif hidden or TORCHRUN_LOG.match(line) or line.startswith("Traceback"):
            hidden.append(line)  # from here on, what torchrun says about the failure
        else:
            shown.append(line)
            if stream:
                click.echo(line, err=True)
    code = child.wait()
    if shown and not stream:
        click.echo("\n".join(shown), err=True)
    if code == 0:
        sys.exit(0)
    if not errors:
        click.echo(_launch_failure(code, hidden, flags), err=True)
    sys.exit(1)


def _launch_failure(code: int, hidden: list[str], flags: dict) -> str:
    joined = re.search(r"(\d+)/(\d+) clients joined", "\n".join(hidden))
    if joined:
        count, nnodes = int(joined.group(1)), int(joined.group(2))
        this = flags["node_rank"] or 0
        missing = [n for n in range(nnodes) if n != this] if count == 1 else None
        which = f"node {', '.join(map(str, missing))} did not" if missing else f"{nnodes - count} did not"
        there = f" there (--node-rank {', '.join(map(str, missing))}" if missing else " on every node (--node-rank"
        return (f"error: {count} of {nnodes} nodes joined within the join timeout ({flags['join_timeout']:g} s); "
                f"{which}: start this command{there}, the same --master-addr and --master-port)")
    return "\n".join([f"error: a rank failed (torchrun exit status {code}):"] + hidden[-20:])


def join_group(device: str = "cpu", timeout_s: float = DEFAULT_JOIN_TIMEOUT_S) -> int:
    """Initialise this rank's default group from torchrun's environment; returns the rank. On
    CUDA the local rank's device becomes current and NCCL carries CUDA tensors."""
    import torch
    import torch.distributed as dist

    backend = "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank()


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def open_rank(flags: dict, device: str):
    """Join the group, then the control channel (bound by the step deadline once every rank is up):
    (rank, channel)."""
    from b12x_toolchain.runtime.parallel.control import ControlChannel

    rank = join_group(device, flags["join_timeout"])
    return rank, ControlChannel(flags["step_deadline"], flags["join_timeout"])


def run_worker(package: str, options, channel, join_timeout_s: float) -> None:
    """A rank other than 0: load this rank, follow rank 0 until it stops, exit (1 on failure).
    Signals are rank 0's to act on: it drains, then tells this rank to stop."""
    from b12x_toolchain.runtime import PackageError, load
    from b12x_toolchain.runtime.parallel.control import RankLost
    from b12x_toolchain.runtime.parallel.lockstep import worker_error
    from b12x_toolchain.runtime.serving.ranks import follow_leader

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    try:
        follow_leader(load(package, rank=channel.rank, peer_timeout=join_timeout_s), options, channel)
    except (RankLost, PackageError, ValueError, OSError, RuntimeError) as exc:
        worker_error(channel.rank, exc)
        sys.exit(1)
    finally:
        leave_group()
    sys.exit(0)
