"""`b12x serve --nproc` in processes of its own, for the tests: started on a free port, its
log read as it comes, every process it started found, and what a test asks of it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def children(pid: int) -> list[int]:
    """Every process below `pid` (its children, theirs, ...), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(v.split(b"=", 1)[1]) for v in environ if v.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class RankServer:
    """One node's `b12x serve PKG --nproc N ...` (all of it when --nnodes is 1)."""

    def __init__(self, package, *args, port: int | None = None, serves: bool = True):
        self.port = port or free_port()
        command = [sys.executable, "-m", "b12x_toolchain.exporter.cli.main", "serve", str(package),
                   "--port", str(self.port), *map(str, args)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = f"http://127.0.0.1:{self.port}"
        if serves:
            self.wait_for(" at http://", 180)

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None, f"the server exited ({self.process.returncode}):\n{self.log}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.log}"
            time.sleep(0.1)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def processes(self) -> list[int]:
        """The launcher and every process below it (torchrun, the ranks)."""
        return [self.process.pid] + children(self.process.pid)

    def rank_pid(self, rank: int) -> int:
        found = [pid for pid in children(self.process.pid) if rank_of(pid) == rank]
        assert len(found) == 1, (rank, found)
        return found[0]

    def signal_rank(self, rank: int, sig: signal.Signals) -> None:
        os.kill(self.rank_pid(rank), sig)

    def wait(self, timeout: float) -> int:
        code = self.process.wait(timeout)
        self._reader.join(5)
        return code

    def stop(self) -> None:
        """Whatever is left of it (a test that failed midway), gone."""
        for pid in reversed(self.processes()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.process.wait(30)
