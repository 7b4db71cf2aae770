"""`b12x run --nproc 2`: torchrun starts one process per rank of a parallel package, rank 0
reports, and the tokens are one device's. A world the package was not exported for is
refused before anything starts, a rank's bad input is one error line, no traceback, and the
launcher itself imports no torch.
(`b12x export` of a parallel recipe reporting every rank's passes: test_parallel_packages,
whose structural package is that command's export.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main

pytestmark = pytest.mark.slow(minutes=0.5)

PROMPT = "5 17 301 44 9 260 3 77 120 31"


@pytest.fixture(scope="module")
def chat_parallel(chat_parallel_path):
    return chat_parallel_path("tensor2-expert2")


def b12x(*args):
    """`b12x run` in a process of its own: the launcher hands its own command line to torchrun."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "b12x_toolchain.exporter.cli.main", "run", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=600)


def b12x_here(*args):
    """`b12x run` in this process: for what never reaches torchrun (one device, or a refusal before launch)."""
    return CliRunner().invoke(main, ["run", *map(str, args)])


def tokens(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("request ")]


def test_two_ranks_decode_what_one_device_decodes(chat_parallel, chat_path):
    one = b12x_here(chat_path, "--prompt-ids", PROMPT, "--max-new-tokens", 8, "--greedy")
    two = b12x(chat_parallel, "--nproc", 2, "--prompt-ids", PROMPT, "--max-new-tokens", 8, "--greedy")
    assert one.exit_code == 0, one.output
    assert two.returncode == 0, two.stderr
    assert tokens(two.stdout) == tokens(one.stdout) and len(tokens(one.stdout)) == 1
    assert two.stdout.count("plain greedy decoding") == 1  # rank 0 alone reports


def test_a_world_the_package_was_not_exported_for_is_refused_before_launch(chat_parallel, chat_path):
    three = b12x_here(chat_parallel, "--nproc", 3, "--prompt-ids", PROMPT)
    assert three.exit_code == 1 and three.stdout == ""
    assert three.stderr.strip() == (f"error: --nproc 3 x --nnodes 1 makes world size 3; {chat_parallel} was "
                                    "exported for tensor 2, expert 2 (world size 2)")
    one_device = b12x_here(chat_path, "--nproc", 2, "--prompt-ids", PROMPT)
    assert one_device.exit_code == 1 and "was exported for one device" in one_device.stderr


def test_an_edited_manifest_is_refused_before_launch(chat_parallel, tmp_path):
    """The launcher reads the world size as strict JSON, but only from a manifest whose digest
    holds: an edited one is checked in full and refused once, before any rank starts."""
    edited = shutil.copytree(chat_parallel, tmp_path / chat_parallel.name)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["recipe"]["model"]["rope_theta"] = 12345.0
    (edited / "manifest.json").write_text(json.dumps(manifest))
    refused = b12x_here(edited, "--nproc", 2, "--prompt-ids", PROMPT)
    assert refused.exit_code == 1 and refused.stdout == ""
    assert refused.stderr.strip() == "error: manifest.json: manifest_sha256 does not match its contents (corrupted or edited)"


def test_a_ranks_bad_input_is_one_error_line(chat_parallel):
    bad = b12x(chat_parallel, "--nproc", 2, "--prompt-ids", "1 2 99999")
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "99999" in lines[0], bad.stderr


LAUNCHER = """
import sys
from b12x_toolchain.exporter.cli import ranks
from b12x_toolchain.exporter.cli.main import main

def launched(flags, stream):
    print("launched", flags["nproc"], "torch" in sys.modules)
    sys.exit(0)

ranks.launch = launched
main(sys.argv[1:])
"""


@pytest.mark.parametrize("command", [["run", "--prompt-ids", PROMPT, "--threads", "1"], ["serve"]])
def test_the_launcher_imports_no_torch(chat_parallel, command):
    """What a user starts with --nproc checks the world and hands over to torchrun without
    importing torch (seconds on every node); the ranks import it and check the package."""
    done = subprocess.run([sys.executable, "-c", LAUNCHER, command[0], str(chat_parallel), *command[1:], "--nproc", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "launched 2 False"
