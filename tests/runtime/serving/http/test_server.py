"""`b12x serve` end to end: a real uvicorn server on a loopback port, driven by the official client.

One server serves the whole module (the package is the suite's shared dsv41-small export);
the last test restarts it on the same L2 directory.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.requests import Request
from conftest import random_tokens
from http_serving import client, metric, pages_in_use, scrape, start_server
from same_tokens import assert_same_tokens

MODEL = "dsv41-small"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def l2_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("l2")


@pytest.fixture(scope="module")
def server(small_path, l2_dir):
    server = start_server(small_path, prefix_cache_dir=str(l2_dir))
    yield server
    server.shutdown()


def prompts(count: int, seed: int, low: int = 4, high: int = 40) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [random_tokens(gen, int(torch.randint(low, high, (1,), generator=gen))) for _ in range(count)]


def stream_ids(api, prompt: list[int], max_tokens: int) -> list[int]:
    ids = []
    for chunk in api.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True):
        for choice in chunk.choices:
            ids += choice.token_ids
    return ids


def test_completion_by_token_ids(server):
    api = client(server)
    assert [m.id for m in api.models.list().data] == [MODEL]
    done = api.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4)
    (choice,) = done.choices
    assert choice.text == "" and len(choice.token_ids) == 4 and choice.finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (4, 4, 8)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_streams_match_the_engine_offline(server, small_pkg):
    """16 concurrent greedy streams give the tokens the engine gives the same requests offline."""
    requests = [Request(p, max_new_tokens=4, id=i) for i, p in enumerate(prompts(16, seed=16))]
    api = client(server)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda r: stream_ids(api, list(r.prompt), r.max_new_tokens), requests))
    session = small_pkg.session(slots=server.service.session.slots, passes=("prefill", "verify", "commit", "draft"))
    offline = Engine(session).generate(requests)
    for request, tokens, state in zip(requests, got, offline):
        assert_same_tokens(tokens, state.tokens, f"request {request.id}")


def test_answers_do_not_depend_on_the_concurrency(server):
    """The same 16 requests, greedy and sampled with seeds, sent one at a time, 4 and 16 at once
    (and so batched with other neighbours, in other slots, some from the prefix cache): every
    request's tokens are the same each time."""
    api = client(server)
    work = [(p, {} if i % 2 else {"temperature": 0.8, "seed": 100 + i}) for i, p in enumerate(prompts(16, seed=31))]

    def ask(item):
        prompt, sampling = item
        return api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **sampling).choices[0].token_ids

    answers = []
    for concurrency in (1, 4, 16):
        with ThreadPoolExecutor(concurrency) as pool:
            answers.append(list(pool.map(ask, work)))
    for i in range(len(work)):
        assert answers[1][i] == answers[0][i] and answers[2][i] == answers[0][i], f"request {i}"


def test_stream_usage_and_cached_tokens(server):
    api = client(server)
    prompt = prompts(1, seed=3)[0]
    first = api.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(api.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                         stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(prompt)  # an exact hit
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert sum((c.choices[0].token_ids for c in chunks[:-1]), []) == first.choices[0].token_ids


def test_chat_needs_a_tokenizer(server):
    if server.service.codec is not None:
        pytest.skip("the package has a tokenizer")
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["message"] == "this package has no tokenizer; send token ids"
    assert caught.value.body["param"] == "messages"


def test_metrics_agree_with_the_responses(server):
    api = client(server)
    before = scrape(server)
    usages, cached = [], 0
    for prompt in prompts(3, seed=7):
        usages.append(api.completions.create(model=MODEL, prompt=prompt, max_tokens=3).usage)
    usages.append(api.completions.create(model=MODEL, prompt=prompts(3, seed=7)[0], max_tokens=3).usage)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert cached > 0
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3, presence_penalty=0.5)
    after = scrape(server)
    delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)
    assert delta("b12x_requests_total", outcome="length") == 4
    assert delta("b12x_refused_requests_total", status="400") == 1
    assert delta("b12x_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("b12x_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("b12x_prefix_cached_tokens_total") == cached
    assert delta("b12x_prefix_hits_total", tier="l1") == 1
    assert delta("b12x_time_to_first_token_seconds_count") == 4
    # Every decoding row-step either verified 7 drafts or, while drafting did not pay (this package's
    # random drafter), decoded one token without drafting.
    drafts = delta("vllm:spec_decode_num_drafts_total")
    assert delta("b12x_drafted_tokens_total") == 7 * drafts
    assert drafts + delta("b12x_draft_aside_row_steps_total") > 0
    assert metric(after, "b12x_running_requests") == 0 and metric(after, "b12x_queue_depth") == 0


def test_errors_are_openai_shaped_and_the_server_keeps_serving(server):
    api, url = client(server), server.url + "/v1/completions"
    limit = server.service.limits.max_seq_len

    def refused(status: int, **kwargs) -> dict:
        response = httpx.post(url, **kwargs)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error

    assert refused(400, content=b"{not json")["code"] == "invalid_json"
    error = refused(400, json={"prompt": [1] * limit, "max_tokens": 1})
    assert "max_seq_len" in error["message"] and error["param"] == "prompt"
    assert "max_seq_len" in refused(400, json={"prompt": [1, 2], "max_tokens": limit})["message"]
    assert refused(400, json={"prompt": [1, 10**6], "max_tokens": 1})["code"] == "invalid_token_id"
    assert refused(400, json={"prompt": [1], "logprobs": 21})["param"] == "logprobs"
    assert refused(400, json={"prompt": [1], "best_of": 3})["param"] == "best_of"
    assert refused(400, json={"prompt": [1], "frobnicate": 1})["code"] == "unknown_parameter"
    assert refused(404, json={"prompt": [1], "model": "other"})["code"] == "model_not_found"
    service = server.service
    service.options.max_body_bytes, limit_before = 64, service.options.max_body_bytes
    try:
        assert refused(413, json={"prompt": [1] * 100})["code"] == "request_too_large"
    finally:
        service.options.max_body_bytes = limit_before
    service.options.api_key = "right"
    try:
        assert refused(401, json={"prompt": [1]}, headers={"Authorization": "Bearer wrong"})["type"] == \
            "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            client(server, api_key="wrong").completions.create(model=MODEL, prompt=[1], max_tokens=1)
        assert client(server, api_key="right").completions.create(model=MODEL, prompt=[1], max_tokens=1).usage
        assert httpx.get(server.url + "/health").status_code == 200  # health needs no key
    finally:
        service.options.api_key = None
    assert api.completions.create(model=MODEL, prompt=[9, 9], max_tokens=1).choices[0].token_ids


def test_disconnect_frees_the_slot_and_a_full_queue_gives_503(server):
    """Streams hold every slot; with no room to wait the next request gets 503; closing the streams
    cancels their requests, and their slots and pages come back (seen in /metrics)."""
    api, slots = client(server), server.service.session.slots
    shared = prompts(1, seed=11)[0]
    api.completions.create(model=MODEL, prompt=shared, max_tokens=1)  # its snapshot holds pages from now on
    baseline = pages_in_use(scrape(server))
    server.service.loop.max_queue = 0
    streams = []
    try:
        for _ in range(slots):
            stream = api.completions.create(model=MODEL, prompt=shared, max_tokens=200, stream=True)
            next(iter(stream))  # it runs
            streams.append(stream)
        assert metric(scrape(server), "b12x_running_requests") == slots
        with pytest.raises(openai.APIStatusError) as caught:
            api.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1)
        assert caught.value.status_code == 503 and caught.value.response.headers["Retry-After"]
        assert caught.value.body["code"] == "queue_full"
    finally:
        server.service.loop.max_queue = 64
        for stream in streams:
            stream.close()
    done = threading.Event()
    for _ in range(200):
        samples = scrape(server)
        if metric(samples, "b12x_running_requests") == 0 and pages_in_use(samples) == baseline:
            done.set()
            break
        threading.Event().wait(0.05)
    assert done.is_set(), f"running {metric(samples, 'b12x_running_requests')}, pages {pages_in_use(samples)} " \
                          f"instead of {baseline}"
    assert metric(samples, "b12x_requests_total", outcome="cancelled") == slots
    assert api.completions.create(model=MODEL, prompt=[4, 4], max_tokens=1).choices[0].token_ids


@pytest.fixture
def with_text(server):
    """The module's server with a small trained tokenizer, as if its package carried one."""
    from b12x_toolchain.exporter.train.tokenizer import tokenizer_config, train_tokenizer
    from b12x_toolchain.runtime.serving.text import TextCodec

    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n" * 20, "café: 中文 and 🙂 naïve\n"], vocab_size=300)
    codec = TextCodec.from_files(tokenizer.to_str().encode(), json.dumps(tokenizer_config()).encode())
    before, server.service.codec = server.service.codec, codec
    yield codec
    server.service.codec = before


def test_text_prompts_chat_and_stop_strings(server, with_text):
    api, codec = client(server), with_text
    prompt = "def f(x):\n    return"
    whole = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    assert whole.usage.prompt_tokens == len(codec.encode(prompt))
    text = whole.choices[0].text
    streamed = "".join(c.choices[0].text for c in api.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                                          stream=True))
    assert streamed == text and len(text) >= 4, text
    stop = text[2:4]
    cut = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    # The ids stop with the token that completed the stop string (test_answer_text.py holds
    # the exact cut on the shipped tokenizer; this random model's bytes decode to U+FFFD).
    ids, text_of = cut.choices[0].token_ids, lambda ids: codec.decode([i for i in ids if i < codec.vocab_size])
    assert ids == whole.choices[0].token_ids[: len(ids)] and stop in text_of(ids)
    cut = "".join(c.choices[0].text for c in api.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                                                     stop=stop, stream=True))
    assert cut == text[: text.index(stop)]
    messages = [{"role": "user", "content": "print the squares"}]
    chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert isinstance(chat.choices[0].message.content, str) and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(codec.encode(codec.apply_chat_template(messages)))
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content


def test_restart_hits_the_l2_prefix_cache(server, small_path, l2_dir):
    """Shutting down writes the L2 cache out; a new server on the same directory hits it. Runs last:
    it stops the module's server."""
    prompt = prompts(1, seed=21)[0]
    api = client(server)
    assert api.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage.prompt_tokens_details.cached_tokens == 0
    server.shutdown()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")
    again = start_server(small_path, prefix_cache_dir=str(l2_dir))
    try:
        usage = client(again).completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage
        assert usage.prompt_tokens_details.cached_tokens == len(prompt)
        assert metric(scrape(again), "b12x_prefix_hits_total", tier="l2") == 1
    finally:
        again.shutdown()
