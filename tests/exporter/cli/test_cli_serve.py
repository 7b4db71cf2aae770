"""`b12x serve` as a process: it starts, answers, and on SIGTERM drains (503 for new requests while
a running one finishes), writes its L2 prefix cache out and exits 0; bad options fail without a traceback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
from click.testing import CliRunner

from b12x_toolchain.exporter.cli.main import main

URL = re.compile(r"at (http://\S+)/v1")


def test_bad_options_fail_cleanly(tmp_path, small_path):
    result = CliRunner().invoke(main, ["serve", str(tmp_path / "missing.b12x")])
    assert result.exit_code == 2 and "does not exist" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["serve", str(small_path), "--pages", "4", "--cache-bytes", "4096"])
    assert result.exit_code == 2 and "--pages (4) and --cache-bytes (4096) both size the paged caches; give one of them" in result.output
    result = CliRunner().invoke(main, ["serve", str(tmp_path)])  # a folder that is no package
    assert result.exit_code == 1 and result.output.startswith("error: ") and "Traceback" not in result.output


def test_sigterm_drains_and_writes_the_l2_cache(tmp_path, small_path):
    l2 = tmp_path / "l2"
    env = dict(os.environ, OMP_NUM_THREADS="1", B12X_API_KEY="k")
    process = subprocess.Popen([sys.executable, "-m", "b12x_toolchain.exporter.cli.main", "serve", str(small_path),
                                "--port", "0", "--prefix-cache-dir", str(l2), "--grace-seconds", "60"],
                               env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        url = URL.search(line).group(1)
        key = {"Authorization": "Bearer k"}
        assert httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}).status_code == 401
        # Long enough to be still streaming well after the SIGTERM below: a short one can finish and let
        # the server exit before the request that must be refused while it drains.
        body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 400, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=key, timeout=60) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it runs
            process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, headers=key)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=60) == 0
        assert any(name.endswith(".safetensors") for name in os.listdir(l2))
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()


def test_serve_with_no_engine_flags_restores_a_repeated_prompt(small_path):
    # The prefix cache is on by default, as in `b12x run` and the loader API: the second time a
    # prompt comes, its prefill is restored from the first one's snapshot.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, "-m", "b12x_toolchain.exporter.cli.main", "serve", str(small_path),
                                "--port", "0"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = URL.search(process.stderr.readline()).group(1)
        body = {"prompt": [(7 * i) % 50 + 1 for i in range(70)], "max_tokens": 2}
        cached = [httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
                  ["prompt_tokens_details"]["cached_tokens"] for _ in range(2)]
        assert cached[0] == 0 and cached[1] > 0, cached
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()
