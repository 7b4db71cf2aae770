"""Virtual environments of the real clients users point at `b12x serve`, made on demand.

Each client gets its own venv under the repository's `.venv-clients/<name>/` (git ignores
it), made by `uv venv` and `uv pip install` of exact pins (uv is a dev dependency: it resolves,
downloads and links in parallel, where pip took 50 s for lm-eval alone and a minute more for
GuideLLM, a core's worth of the suite's time). A stamp file,
written last, records what was installed; a venv whose stamp names the same pins is reused,
any other is made again. Two pytest workers asking at once are serialised by a file lock
beside the venv: the second waits, then finds the first one's stamp. Every uv run has a
time limit, so a hung download fails the test instead of the suite.

lm-eval's `api` extra pulls no torch. GuideLLM 0.8.1 requires torch outright (no extra
leaves it out: its only data loader, guidellm/data/loaders/torch.py, imports
torch.utils.data), so its venv links this project's torch (LINKED) instead of installing a
second copy; pip finds it installed and adds only what it depends on.

`PYTHONPATH=tests .venv/bin/python -m clients.venvs [name ...]` makes them ahead of a run.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from filelock import FileLock
from uv import find_uv_bin

from paths import ROOT

VENVS = ROOT / ".venv-clients"
# name -> pip requirements, each pinned exactly.
CLIENTS = {
    "lm-eval": ("lm_eval[api]==0.4.13",),
    "guidellm": ("guidellm==0.8.1",),
}
# Packages a client venv takes from the project's venv, linked rather than installed: pip then
# finds them installed (their dependencies it installs itself). GuideLLM imports torch for its
# data loader only; a second copy would cost 1.5 GB and a minute or two of unpacking.
LINKED = {"guidellm": ("torch",)}
# A client process writes the bytecode of the modules it imports into its venv even where the
# environment says not to (an empty value lets Python write it): the next run reads it.
CLIENT_ENV = {"PYTHONDONTWRITEBYTECODE": ""}
INSTALL_TIMEOUT_S = 900  # one venv's creation, its install included (seconds from a warm uv cache)
STAMP = ".client-installed.json"


def _stamp(name: str) -> dict:
    # The interpreter too: a venv made from another one (the Makefile picks the faster) is made again.
    return {"requirements": list(CLIENTS[name]), "linked": list(LINKED.get(name, ())), "python": sys.version}


def _ready(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / STAMP).read_text()) == stamp and (folder / "bin" / "python").exists()
    except (OSError, ValueError):
        return False


def _run(command: list, deadline: float, what: str) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"{what}: no time left of {INSTALL_TIMEOUT_S} s")
    try:
        result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=left,
                                env={**os.environ, "PIP_NO_INPUT": "1", "UV_NO_PROGRESS": "1"})
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{what}: still running after {INSTALL_TIMEOUT_S} s: {' '.join(map(str, command))}") \
            from None
    if result.returncode != 0:
        raise RuntimeError(f"{what}: {' '.join(map(str, command))} exited {result.returncode}\n"
                           f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")


def _link(package: str, folder: Path) -> None:
    """The project's installed `package` in the venv at `folder`: every top-level folder it
    installs linked (torch brings torchgen and functorch too), its dist-info copied (pip reads
    that to know what is installed)."""
    distribution = importlib.metadata.distribution(package)
    source = Path(distribution.locate_file(""))
    target = Path(sysconfig.get_path("purelib", vars={"base": str(folder), "platbase": str(folder)}))
    tops = {file.parts[0] for file in distribution.files or () if file.parts[0] != ".."  # .. : its scripts
            and (source / file.parts[0]).is_dir() and not file.parts[0].endswith(".dist-info")}
    for top in sorted(tops):
        (target / top).symlink_to(source / top, target_is_directory=True)
    info = source / f"{distribution.metadata['Name']}-{distribution.version}.dist-info"
    shutil.copytree(info, target / info.name)


def client_venv(name: str) -> Path:
    """The venv of client `name` (a key of CLIENTS), made first if it is missing or stale."""
    folder, stamp = VENVS / name, _stamp(name)
    if _ready(folder, stamp):
        return folder
    VENVS.mkdir(exist_ok=True)
    with FileLock(str(folder) + ".lock", timeout=INSTALL_TIMEOUT_S + 60):
        if _ready(folder, stamp):  # another worker made it while this one waited
            return folder
        deadline = time.monotonic() + INSTALL_TIMEOUT_S
        shutil.rmtree(folder, ignore_errors=True)  # a stale or half-made one
        uv = find_uv_bin()
        # The project venv's own interpreter (uv takes its base): the linked packages were built for it.
        _run([uv, "venv", "-q", "--python", sys.executable, folder], deadline, f"making the {name} venv")
        for package in LINKED.get(name, ()):
            _link(package, folder)
        # Not byte-compiled here (all of lm-eval's dependencies: 30 s of CPU against 7 s for the
        # install): each client run writes the bytecode of what it imports (CLIENT_ENV), once.
        _run([uv, "pip", "install", "-q", "--python", folder / "bin" / "python", *CLIENTS[name]], deadline,
             f"installing {name}")
        (folder / STAMP).write_text(json.dumps(stamp))
    return folder


def build_in_background() -> subprocess.Popen:
    """Make every client venv in a child process started now: its downloads and installs then
    overlap other tests instead of holding a pytest worker; a test that needs a venv still being
    made waits for it through the lock."""
    VENVS.mkdir(exist_ok=True)
    with open(VENVS / "build.log", "w") as out:
        return subprocess.Popen([sys.executable, "-m", "clients.venvs"], cwd=Path(__file__).parent.parent,
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})


if __name__ == "__main__":
    for client in sys.argv[1:] or CLIENTS:
        start = time.monotonic()
        print(client, client_venv(client), f"{time.monotonic() - start:.0f} s")
