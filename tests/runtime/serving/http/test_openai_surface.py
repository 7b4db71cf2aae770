"""What the clients users point at servers send and read (lm-eval, GuideLLM, `vllm bench
serve`), against `b12x serve` of the shipped model: batches of token-id prompts answered
with text, echo with prompt logprobs, n samples, chat logprobs, continuous usage, the
tokenizer routes, vLLM's spec-decode counters, and hostile bodies that must neither
fail the engine nor drop the connection."""

from __future__ import annotations

import http.client
import json
import socket
import time

import httpx
import pytest
import torch

from b12x_toolchain.runtime import load
from decode_steps import prefill
from failing_sampler import FAILING_TEMPERATURE, fail_sampling_at
from http_serving import metric, scrape, start_server

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow(minutes=1)]

PROMPTS = ["def add(a, b):\n", "class Stack:\n    def push(self, item):\n"]


@pytest.fixture(scope="module")
def server(shipped_path):
    server = start_server(shipped_path)
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def codec(server):
    return server.service.codec


def post(server, path: str, body: dict, **kwargs) -> dict:
    response = httpx.post(server.url + path, json=body, timeout=120, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def completion(server, **body) -> dict:
    return post(server, "/v1/completions", {"max_tokens": 6, "temperature": 0} | body)


def test_token_id_batches_answer_text_in_order(server, codec):
    ids = [codec.encode(p) for p in PROMPTS]
    batch = completion(server, prompt=ids)
    texts = completion(server, prompt=PROMPTS)
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    for i, prompt in enumerate(ids):
        (alone,) = completion(server, prompt=prompt)["choices"]
        for got in (batch["choices"][i], texts["choices"][i]):
            assert (got["text"], got["token_ids"]) == (alone["text"], alone["token_ids"])
        assert alone["text"] and alone["text"] == codec.decode(alone["token_ids"])
    assert batch["usage"]["prompt_tokens"] == sum(len(p) for p in ids)


def test_echo_prompt_logprobs_are_a_fresh_prefills(server, codec):
    """lm-eval's loglikelihood body; its numbers equal a fresh prefill's log-softmax."""
    prompt = codec.encode(PROMPTS[1])
    body = {"prompt": [prompt], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    (choice,) = post(server, "/v1/completions", body)["choices"]
    logprobs = choice["logprobs"]
    session = load(server.service.options.package).session(slots=1)
    session.reset_slot(0)
    fresh = torch.log_softmax(prefill(session, 0, prompt).to(torch.float32), dim=-1)
    assert len(logprobs["tokens"]) == len(prompt) + 1 and logprobs["token_logprobs"][0] is None
    for position in range(1, len(prompt)):
        row = fresh[position - 1]
        assert abs(logprobs["token_logprobs"][position] - float(row[prompt[position]])) < 1e-5
        best = codec.decode([int(row.argmax())])
        assert abs(logprobs["top_logprobs"][position][best] - float(row.max())) < 1e-5
    assert choice["text"] == "".join(logprobs["tokens"]) == PROMPTS[1] + codec.decode(choice["token_ids"])
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(prompt) + 1)]
    streamed = {"tokens": [], "token_logprobs": []}
    with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for key in streamed:
                    streamed[key] += (json.loads(line[6:])["choices"][0]["logprobs"] or {}).get(key, [])
    assert streamed == {key: logprobs[key] for key in streamed}


def test_n_samples_are_single_requests_with_derived_seeds(server):
    many = completion(server, prompt=PROMPTS[0], n=4, seed=11, temperature=1.0)["choices"]
    singles = [completion(server, prompt=PROMPTS[0], seed=11 + j, temperature=1.0)["choices"][0] for j in range(4)]
    assert [c["token_ids"] for c in many] == [c["token_ids"] for c in singles]
    assert len({tuple(c["token_ids"]) for c in many}) > 1


def test_more_choices_than_slots_and_queue_hold_is_a_400_not_a_retry(server):
    loop = server.service.loop
    too_many = len(server.service.engine.slots) + loop.max_queue + 1
    response = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "n": too_many})
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_choices"
    assert "Retry-After" not in response.headers


def test_chat_logprobs_and_continuous_usage_on_a_stream(server):
    messages = [{"role": "user", "content": "write a loop"}]
    body = {"messages": messages, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2,
            "ignore_eos": True, "temperature": 0}
    (choice,) = post(server, "/v1/chat/completions", body)["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == 5 == len(choice["token_ids"])
    for item in content:
        assert item["top_logprobs"][0]["token"] == item["token"]  # greedy: the likeliest token
        assert item["top_logprobs"][0]["logprob"] >= item["top_logprobs"][1]["logprob"]
    chunks = []
    stream_body = body | {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=stream_body, timeout=120) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and not chunks[-1]["choices"]
    assert all("usage" in c for c in chunks)


def test_documented_defaults_ignore_eos_and_request_ids(server, codec):
    defaults = {"logprobs": False, "n": 1, "stop": None, "echo": False, "presence_penalty": 0, "frequency_penalty": 0.0,
                "repetition_penalty": 1.0, "best_of": 1, "top_k": -1, "user": "someone", "stream": False,
                "stream_options": None, "suffix": None, "logit_bias": None, "seed": None, "top_p": None}
    plain = completion(server, prompt=PROMPTS[0])
    assert completion(server, prompt=PROMPTS[0], **defaults)["choices"][0]["text"] == plain["choices"][0]["text"]
    eos = codec.eos_id
    stop_at_eos = completion(server, prompt=PROMPTS[0], stop=[plain["choices"][0]["token_ids"][0]], max_tokens=8)
    assert stop_at_eos["usage"]["completion_tokens"] == 1 and eos is not None
    # The answer's first token is a (hidden) stop token: echo still puts the prompt first.
    echoed = completion(server, prompt=PROMPTS[0], stop=[plain["choices"][0]["token_ids"][0]], echo=True)
    assert echoed["choices"][0]["text"] == PROMPTS[0]
    ignored = completion(server, prompt=PROMPTS[0], max_tokens=12, ignore_eos=True)
    assert ignored["usage"]["completion_tokens"] == 12
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                          headers={"X-Request-Id": "trace-42"})
    assert response.headers["x-request-id"] == "trace-42"


def test_tokenizer_routes(server, codec):
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == codec.token(codec.eos_id) and info["chat_template"] == codec.chat_template
    tokens = post(server, "/tokenize", {"prompt": PROMPTS[1], "add_special_tokens": False})
    assert tokens["tokens"] == codec.encode(PROMPTS[1]) and tokens["count"] == len(tokens["tokens"])
    assert post(server, "/tokenize", {"prompt": info["eos_token"]})["tokens"] == [codec.eos_id]
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}) == {"prompt": PROMPTS[1]}
    messages = [{"role": "user", "content": "hi"}]
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 1})
    assert post(server, "/tokenize", {"messages": messages})["count"] == chat["usage"]["prompt_tokens"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]  # GuideLLM's and vllm bench's shape
    assert post(server, "/v1/chat/completions", {"messages": parts, "max_completion_tokens": 1})["choices"] == \
        chat["choices"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    refused = httpx.post(server.url + "/v1/chat/completions", json={"messages": image})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_content"


def test_spec_decode_counters_under_vllm_names(server):
    before = scrape(server)
    completion(server, prompt=PROMPTS[1], max_tokens=24)
    after = scrape(server)
    delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    drafts, accepted = delta("vllm:spec_decode_num_drafts_total"), delta("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= delta("vllm:spec_decode_num_draft_tokens_total")
    assert accepted == delta("b12x_accepted_tokens_total")
    per_position = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(8)]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)


def raw_exchange(connection: http.client.HTTPConnection, body: bytes) -> tuple[int, dict]:
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    return response.status, json.loads(response.read())


HOSTILE = [b'{"prompt": "\\ud800 x", "max_tokens": 2}',
           b'{"prompt": "x", "max_tokens": 2, "user": "\\udfff"}',
           b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}',
           b'{"prompt": "x", "max_tokens": 2, "top_p": 1e999}',
           b'{"prompt": "x", "max_tokens": 1e308}',
           b'{"prompt": "x", "seed": 1.5}',
           b'{"prompt": "x", "logprobs": true}',
           b'{"prompt": [[]]}',
           b'{"prompt": "x", "stream_options": {"include_usage": 3}}',
           b'{"prompt": "x", "n": 0}',
           b'[' * 5000 + b']' * 5000]


def test_hostile_bodies_get_400_on_a_connection_that_stays_open(server):
    connection = http.client.HTTPConnection(*server.address, timeout=60)
    connection.connect()
    sock = connection.sock
    for body in HOSTILE:
        status, answer = raw_exchange(connection, body)
        assert status == 400, (body[:60], answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert connection.sock is sock, f"the connection was closed after {body[:60]!r}"
    status, answer = raw_exchange(connection, b'{"prompt": "x", "max_tokens": 3, "temperature": 5e-324}')
    assert status == 200 and answer["choices"][0]["token_ids"] == \
        completion(server, prompt="x", max_tokens=3)["choices"][0]["token_ids"]  # below 1e-5: greedy
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_failing_request_ends_alone(server, monkeypatch):
    fail_sampling_at(monkeypatch)
    response = httpx.post(server.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 3, "temperature": FAILING_TEMPERATURE})
    assert response.status_code == 500 and response.json()["error"]["code"] == "request_failed"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert completion(server, prompt="x", temperature=0.7, seed=1)["choices"][0]["token_ids"]


def test_a_trickled_body_gets_408_and_holds_no_slot(server):
    server.service.options.body_timeout_s = 0.5
    try:
        with socket.create_connection(server.address, timeout=10) as slow:
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\":")
            answered = completion(server, prompt="x", max_tokens=2)  # served meanwhile
            start = time.monotonic()
            reply = b""
            while b"request_timeout" not in reply and (piece := slow.recv(4096)):
                reply += piece
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply and answered["choices"]
        assert time.monotonic() - start < 5
    finally:
        server.service.options.body_timeout_s = 30.0


def test_trickled_headers_close_the_connection(server):
    server.service.options.header_timeout_s = 0.5
    try:
        with socket.create_connection(server.address, timeout=10) as slow:
            start = time.monotonic()
            for piece in (b"POST /v1/completions HTTP/1.1\r\n", b"Host: x\r\n", b"Content-Type: appl"):
                slow.sendall(piece)  # a byte now and then: uvicorn's keep-alive timer alone never fires
                time.sleep(0.2)
            assert slow.recv(4096) == b"" and time.monotonic() - start < 5  # closed by the server
        with httpx.Client(base_url=server.url) as kept:  # a request in time is untouched
            assert kept.get("/health").status_code == 200
            time.sleep(0.8)  # idle between requests past the deadline: closed, and httpx reconnects
            assert kept.get("/health").status_code == 200
    finally:
        server.service.options.header_timeout_s = 30.0


def test_openapi_describes_every_route(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    routes = {(path, method) for path, methods in spec["paths"].items() for method in methods}
    assert routes == {("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                      ("/tokenize", "post"), ("/detokenize", "post"), ("/tokenizer_info", "get"),
                      ("/health", "get"), ("/metrics", "get")}
    schema = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "echo", "logprobs", "n", "ignore_eos"} <= set(schema["properties"])
