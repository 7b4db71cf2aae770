"""GuideLLM 0.8.1, unchanged, benchmarking `b12x serve` of the shipped model.

GuideLLM runs from its own venv (tests/clients/venvs.py) with its default route and
transport: streamed chat completions, each request `max_completion_tokens` = the asked
output length with `ignore_eos: true` and `stream_options: {include_usage,
continuous_usage_stats}`. Its synthetic prompts are sized with a tokenizer, given as
`--tokenizer kind=huggingface_auto,model=<folder>` (0.8.1's spelling of the processor): a
folder holding the package's own tokenizer files, so nothing is downloaded. Two runs, a few
small requests each: synchronous, and concurrent with 4 streams. From each run's JSON
report: every request succeeded and each brought exactly the asked number of output tokens.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from b12x_toolchain.runtime import load
from clients.serving import write_tokenizer
from clients.venvs import CLIENT_ENV, client_venv

pytestmark = [pytest.mark.slow(minutes=0.5), pytest.mark.exports, pytest.mark.usefixtures("one_torch_thread")]

RUN_TIMEOUT_S = 240
PROMPT_TOKENS, OUTPUT_TOKENS = 16, 8
PROFILES = {"synchronous": ("kind=synchronous", 3), "concurrent": ("kind=concurrent,streams=4", 8)}  # profile, requests


@pytest.fixture(scope="module")
def processor(shipped_path, tmp_path_factory):
    return write_tokenizer(load(shipped_path), tmp_path_factory.mktemp("processor"))


@pytest.mark.parametrize("mode", PROFILES)
def test_every_request_completes_with_the_asked_output_tokens(served, processor, mode, tmp_path):
    server, recorder = served
    profile, count = PROFILES[mode]
    venv = client_venv("guidellm")
    report, first = tmp_path / "report.json", len(recorder.exchanges)
    env = {**os.environ, **CLIENT_ENV, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home"), "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    command = [venv / "bin" / "guidellm", "run", "--backend", f"kind=openai_http,target={server.url}",
               "--profile", profile, "--constraint", f"kind=max_requests,count={count}",
               "--tokenizer", f"kind=huggingface_auto,model={processor}",
               "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
               "--output", f"kind=json,path={report}", "--disable-console"]
    run = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=RUN_TIMEOUT_S)
    failed = [e for e in recorder.exchanges[first:] if e.failed]
    refused = "\n".join(map(str, failed[:4]))
    assert run.returncode == 0, f"guidellm exited {run.returncode}; the server refused:\n{refused}\n" \
                                f"--- guidellm's stderr\n{run.stderr[-5000:]}"
    chats = [e for e in recorder.exchanges[first:] if e.path == "/v1/chat/completions"]
    print(f"one GuideLLM request body ({mode}):", chats[0].body.decode() if chats else None)
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    errors = [r["info"]["error"] for r in benchmark["requests"]["errored"]]
    # What the server saw: exactly the asked requests, each answered in full.
    assert len(chats) == count and not failed
    assert [usage_of(e)["completion_tokens"] for e in chats] == [OUTPUT_TOKENS] * count
    # GuideLLM 0.8.1's report sometimes leaves out the last request it sent when the machine is
    # loaded (a clean CI run reported 2 of 3 and 7 of 8, each of which the server had answered in
    # full, as checked above): the report must show no failure and at least all but that one.
    totals = benchmark["metrics"]["request_totals"]
    assert totals["errored"] == totals["incomplete"] == 0 and totals["successful"] == totals["total"], \
        f"{errors[:2]}\nthe server refused:\n{refused}"
    assert count - 1 <= totals["total"] <= count
    outputs = benchmark["metrics"]["output_token_count"]["successful"]
    assert (outputs["count"], outputs["min"], outputs["max"]) == (totals["total"], OUTPUT_TOKENS, OUTPUT_TOKENS)
    body = chats[0].json()
    assert (body["stream"], body["ignore_eos"], body["max_completion_tokens"]) == (True, True, OUTPUT_TOKENS)


def usage_of(exchange) -> dict:
    """The usage of a streamed answer: the last chunk that carries one."""
    chunks = [json.loads(line[6:]) for line in exchange.response.decode().splitlines() if line.startswith("data: {")]
    return [c["usage"] for c in chunks if c.get("usage")][-1]
