"""`b12x serve --nproc 2` (and `--nnodes 2` on loopback), driven by the official client: every
answer is the one-device server's, a rank's metrics carry its rank, a rank killed mid-stream
ends the stream with an error, turns /health to 503 and stops every process within the
deadline, SIGTERM drains every stream and stops every rank with its L2 written, and a node
that never starts is named.

Packages: conftest.py here (the small recipe, float32 caches, the shipped tokenizer). The
one-device server runs in this process; each parallel one is a launcher, torchrun and a
process per rank (rank_servers.py).
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from benchmarks.serving_ranks import control_cost, control_counters
from http_serving import client, start_server
from rank_servers import RankServer, alive, free_port

pytestmark = [pytest.mark.slow(minutes=2.5), pytest.mark.usefixtures("one_torch_thread")]

MODEL = "dsv41-chat"
PROMPTS = ["def add(a, b):\n", "class Stack:\n    def push(self, item):\n", "import os\n\n",
           "for i in range(10):\n", "# Read a file\n", "def main():\n    args = ", "while True:\n", "x = ["]
LONG = "def parse(text):\n    " + "tokens = text.split()\n    " * 6  # several prefill chunks: a prefix hit
DEADLINE = 5  # --step-deadline of the servers a test stops by force


GREEDY = {"model": MODEL, "max_tokens": 12, "temperature": 0}


def ask(api: openai.OpenAI, everything: bool = True) -> list:
    """The same requests, in the same order, of any server: what each answered. Without
    `everything`, the greedy ones alone (ask(...)[:4] + ask(...)[-2:])."""
    out = []
    for stream in (False, True):
        out.append(_completion(api, prompt=PROMPTS[0], stream=stream, **GREEDY))
        out.append(_chat(api, content=PROMPTS[1], stream=stream, **GREEDY))
    if everything:
        out += _sampled_and_concurrent(api)
    return out + [_completion(api, prompt=LONG, usage=True, **GREEDY) for _ in range(2)]


def _sampled_and_concurrent(api: openai.OpenAI) -> list:
    out = []
    out.append(_completion(api, prompt=PROMPTS[2], model=MODEL, max_tokens=12, temperature=0.8, seed=11))
    out.append(_chat(api, content=PROMPTS[3], model=MODEL, max_tokens=12, temperature=0.9, seed=5, stream=True))
    with ThreadPoolExecutor(8) as pool:  # at once, with stop strings and lengths of their own
        out += list(pool.map(lambda i: _completion(api, prompt=PROMPTS[i], model=MODEL, max_tokens=6 + 3 * i,
                                                   temperature=0, stream=True, stop=["e", "\n"] if i % 2 else None),
                             range(8)))
    return out


def _completion(api, stream=False, usage=False, **body) -> tuple:
    if not stream:
        response = api.completions.create(**body)
        choice = response.choices[0]
        cached = response.usage.prompt_tokens_details.cached_tokens if usage else None
        return "completion", choice.text, choice.finish_reason, cached
    chunks = list(api.completions.create(stream=True, **body))
    return ("stream", "".join(c.choices[0].text for c in chunks if c.choices),
            next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices), None)


def _chat(api, content: str, stream=False, **body) -> tuple:
    messages = [{"role": "user", "content": content}]
    if not stream:
        choice = api.chat.completions.create(messages=messages, **body).choices[0]
        return "chat", choice.message.content, choice.finish_reason
    chunks = list(api.chat.completions.create(messages=messages, stream=True, **body))
    return ("chat stream", "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
            next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason))


@pytest.fixture(scope="module")
def one_device(chat_path):
    server = start_server(chat_path, model_name=MODEL)
    try:
        answers = ask(client(server))
    finally:
        server.shutdown()
    assert any(a[2] == "stop" for a in answers), "no stop string ended a stream"
    assert answers[-1][3] > 0 and answers[-2][3] == 0, "the repeated prompt was no prefix hit"
    return answers


@pytest.fixture(scope="module")
def two_ranks(chat_parallel_path):
    server = RankServer(chat_parallel_path("tensor2-expert2"), "--nproc", 2, "--model-name", MODEL,
                        "--step-deadline", DEADLINE)
    yield server
    server.stop()


def test_tensor_expert_ranks_answer_as_one_device(two_ranks, one_device):
    assert ask(two_ranks.client()) == one_device
    assert "world size 2" in two_ranks.log


def test_each_rank_reports_its_pages_and_replay_time(two_ranks):
    before = control_counters(two_ranks.url)
    two_ranks.client().completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=8, temperature=0)
    time.sleep(1.5)  # a report is gathered at most once a second
    text = httpx.get(two_ranks.url + "/metrics").text
    for rank in ("0", "1"):
        assert f'b12x_rank_pages_in_use{{pool="entry_pages",rank="{rank}"}}' in text
        line = next(x for x in text.splitlines() if x.startswith(f'b12x_rank_replay_seconds{{rank="{rank}"}}'))
        assert float(line.split()[-1]) > 0
    cost = control_cost(before, control_counters(two_ranks.url))  # what the serving_ranks benchmark reports
    assert cost["steps"] >= 4 and cost["control_messages"] >= cost["steps"]
    assert cost["control_us_per_step"] > 0 and 0 < cost["control_share_of_step"] < 1


def test_a_rank_killed_mid_stream_ends_the_stream_and_every_process(two_ranks):
    processes = two_ranks.processes()
    assert len(processes) == 4  # the launcher, torchrun, two ranks
    stream = two_ranks.client().completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=200, temperature=0,
                                                   stream=True)
    next(iter(stream))
    two_ranks.signal_rank(1, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError, match="rank 0 of 2: a peer went away"):
        for _ in stream:
            pass
    assert httpx.get(two_ranks.url + "/health").status_code == 503
    assert two_ranks.wait(timeout=DEADLINE + 30) == 1
    assert time.monotonic() - killed < DEADLINE + 10
    assert not [pid for pid in processes if alive(pid)]
    assert "error: the engine failed: RankLost" in two_ranks.log
    assert "Traceback" not in two_ranks.log


def test_two_nodes_on_loopback_answer_as_one_device_and_sigterm_drains_every_rank(chat_parallel_path, one_device,
                                                                                  tmp_path):
    path, port = chat_parallel_path("tensor2-expert2"), free_port()
    nodes = [RankServer(path, "--nproc", 1, "--nnodes", 2, "--node-rank", node, "--master-addr", "127.0.0.1",
                        "--master-port", port, "--model-name", MODEL, "--prefix-cache-dir", tmp_path, serves=False)
             for node in (0, 1)]
    try:
        nodes[0].wait_for(" at http://", 180)
        # Greedy answers and a prefix hit across nodes; sampling and batching are the same
        # ranks' code as in the one-node test above.
        assert ask(nodes[0].client(), everything=False) == one_device[:4] + one_device[-2:]
        processes = [pid for node in nodes for pid in node.processes()]
        streams = [nodes[0].client().completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=40, temperature=0,
                                                        stream=True) for i in range(4)]
        for stream in streams:
            next(iter(stream))
        nodes[0].signal_rank(0, signal.SIGTERM)  # drains: the running streams finish
        assert [list(stream)[-1].choices[0].finish_reason for stream in streams] == ["length"] * 4
        assert [node.wait(timeout=60) for node in nodes] == [0, 0]
        assert not [pid for pid in processes if alive(pid)]
        assert " at http://" not in nodes[1].log  # the second node serves no HTTP
    finally:
        for node in nodes:
            node.stop()
    files = [sorted(p.name for p in (tmp_path / f"rank-{rank}").glob("*.safetensors")) for rank in (0, 1)]
    assert files[0] and files[0] == files[1]  # every rank's L2 holds its twin of every snapshot


def test_a_node_that_never_starts_is_named_within_the_join_timeout(chat_parallel_path):
    started = time.monotonic()
    alone = RankServer(chat_parallel_path("tensor2-expert2"), "--nproc", 1, "--nnodes", 2, "--node-rank", 0,
                       "--master-addr", "127.0.0.1", "--master-port", free_port(), "--join-timeout", 3, serves=False)
    try:
        assert alone.wait(timeout=60) == 1
    finally:
        alone.stop()
    assert time.monotonic() - started < 3 + 20  # the join timeout, and starting Python and torch
    assert alone.log.strip().splitlines()[-1] == (
        "error: 1 of 2 nodes joined within the join timeout (3 s); node 1 did not: start this command there "
        "(--node-rank 1, the same --master-addr and --master-port)")
