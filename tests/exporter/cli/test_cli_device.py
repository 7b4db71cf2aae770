"""`--device` of `b12x run` and `b12x serve`: cpu is the default and changes nothing; a device
the runtime cannot use here is one `error:` line and exit 1, before anything runs (serve:
before it binds a port). The check is the session's own (runtime/session/device.py)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# A device no machine running this suite has: no CUDA here, or fewer than 64 devices.
UNUSABLE = "cuda" if not torch.cuda.is_available() else "cuda:63"


def invoke(*args):
    return CliRunner().invoke(main, list(map(str, args)), terminal_width=200)


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output  # fail(), not a crash
    (line,) = result.output.strip().splitlines()
    return line


@pytest.mark.parametrize("device, reason", [
    (UNUSABLE, "torch reports no CUDA device" if UNUSABLE == "cuda" else "torch sees"),
    ("mps", "sessions run on cpu or cuda, not mps"),
    ("gpu", "not a device torch can read; expected cpu, cuda or cuda:N"),
])
def test_run_refuses_a_device_it_cannot_use_in_one_line(small_path, device, reason):
    line = one_error_line(invoke("run", small_path, "--prompt-ids", "1,2,3", "--device", device))
    assert line.startswith(f"error: device {device}: {reason}")


def test_run_on_cpu_is_the_default(small_path):
    """The default's output is test_cli_run's; here: cpu is it, and naming it runs as before."""
    help_text = " ".join(invoke("run", "--help").output.split())
    assert "--device TEXT torch device of the session: cpu, cuda (the current CUDA device) or cuda:N" in help_text
    assert "[default: cpu]" in help_text.split("--device TEXT")[1].split("--prefix-cache-dir")[0]
    result = invoke("run", small_path, "--prompt-ids", "1,2,3", "--max-new-tokens", 2, "--greedy", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert [len(line.split()) for line in result.output.splitlines() if line.startswith("request 0 tokens: ")] == [5]


def test_serve_refuses_a_device_it_cannot_use_before_binding_a_port(small_path, monkeypatch):
    from b12x_toolchain.runtime.serving.http import server

    bound = []
    monkeypatch.setattr(server, "bind", lambda *args: bound.append(args))
    monkeypatch.setattr(server.Server, "__init__", lambda self, *args: bound.append(args))
    line = one_error_line(invoke("serve", small_path, "--device", UNUSABLE, "--port", 0))
    assert line.startswith(f"error: device {UNUSABLE}: torch ") and bound == []
