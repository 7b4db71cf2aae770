"""`vllm bench serve`'s requests and its speculative-decoding scrape, against `b12x serve`.

vLLM itself cannot be installed here (it pulls a multi-GB CUDA torch), so this module sends
what its request functions send and reads the answers as they read them
(vllm/benchmarks/lib/endpoint_request_func.py):

- async_request_openai_completions: POST /v1/completions with `model`, `prompt` (text: the
  random dataset decodes random token ids), `repetition_penalty: 1.0`, `max_tokens` (the
  output length), `logprobs` (null unless asked), `stream: true`, `stream_options:
  {include_usage: true}`, and `ignore_eos: true` (`--ignore-eos`, which benchmarks of fixed
  output length pass).
- async_request_openai_chat_completions: POST /v1/chat/completions with `model`,
  `messages: [{role: user, content: [{type: text, text: prompt}]}]` (content as parts),
  `max_completion_tokens`, `stream: true`, `stream_options: {include_usage: true}`,
  `ignore_eos: true`.
- Both read server-sent events split at blank lines, skip `:` comments, stop at `data:
  [DONE]`; a chunk with `choices` is a token event (TTFT at the first, an inter-token
  latency at each later one, `choices[0].text` or `choices[0].delta.content` appended); a
  chunk without choices but with `usage` sets the output length from
  `usage.completion_tokens` (and the prompt length from `usage.prompt_tokens`). A request
  succeeds when the status is 200 and one token event arrived.

The speculative-decoding counters are vLLM's Prometheus names, scraped from /metrics before
and after (as the spec-decode reports of vLLM's benchmarks do):
`vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
`vllm:spec_decode_num_accepted_tokens_total` and
`vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field

import httpx
import pytest
import torch

from b12x_toolchain.runtime import load
from clients.serving import assert_text_is_greedy, greedy_states
from http_serving import scrape

pytestmark = [pytest.mark.exports, pytest.mark.usefixtures("one_torch_thread")]

INPUT_LEN, OUTPUT_LEN = 24, 16
COMPLETIONS, CHATS = 6, 3  # sent all at once, as `vllm bench serve` does at an infinite request rate
SPEC = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass
class Output:  # RequestFuncOutput's fields this test reads
    status: int = 0
    success: bool = False
    generated_text: str = ""
    output_tokens: int | None = None
    prompt_len: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: list[dict] = field(default_factory=list)
    done: bool = False
    error: str = ""


def completions_body(model: str, prompt: str) -> dict:
    return {"model": model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": OUTPUT_LEN, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def chat_body(model: str, prompt: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
            "max_completion_tokens": OUTPUT_LEN, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}


async def request(client: httpx.AsyncClient, url: str, body: dict, chat: bool) -> Output:
    """One streamed request, read as vLLM's request functions read it."""
    output, buffer = Output(), ""
    start = latest = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        output.status = response.status_code
        if response.status_code != 200:
            output.error = (await response.aread()).decode(errors="replace")
            return output
        async for text in response.aiter_text():
            buffer += text
            while "\n\n" in buffer:  # StreamedResponseHandler: one SSE message per blank-line-ended block
                message, buffer = buffer.split("\n\n", 1)
                message = message.strip()
                if not message or message.startswith(":"):
                    continue
                payload = message.removeprefix("data: ")
                if payload == "[DONE]":
                    output.done = True
                    continue
                data = json.loads(payload)
                output.chunks.append(data)
                if choices := data.get("choices"):
                    now = time.perf_counter()
                    if not output.success:
                        output.success, output.ttft = True, now - start
                    else:
                        output.itl.append(now - latest)
                    latest = now
                    piece = choices[0]["delta"].get("content") if chat else choices[0].get("text")
                    output.generated_text += piece or ""
                elif usage := data.get("usage"):
                    output.output_tokens = usage.get("completion_tokens")
                    output.prompt_len = usage.get("prompt_tokens")
    return output


async def benchmark(url: str, bodies: list[tuple[str, dict, bool]]) -> list[Output]:
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        return await asyncio.gather(*(request(client, url + path, body, chat) for path, body, chat in bodies))


def spec_counters(samples: dict) -> tuple[dict[str, float], dict[int, float]]:
    """vLLM's spec-decode counters, summed over their other labels; the per-position one by position."""
    totals, positions = defaultdict(float), defaultdict(float)
    for (name, labels), value in samples.items():
        if name in SPEC:
            totals[name] += value
        elif name == PER_POSITION:
            positions[int(dict(labels)["position"])] += value
    return totals, positions


def random_prompts(codec, count: int, seed: int) -> list[str]:
    """The random dataset's prompts: random token ids, decoded to text."""
    gen = torch.Generator().manual_seed(seed)
    return [codec.decode(torch.randint(3, codec.vocab_size, (INPUT_LEN,), generator=gen).tolist()) for _ in range(count)]


def test_streamed_requests_usage_and_spec_decode_counters(served, shipped_path):
    server, recorder = served
    package = load(shipped_path)
    codec, model = package.tokenizer, server.service.model_name
    prompts = random_prompts(codec, COMPLETIONS + CHATS, seed=5)
    bodies = [("/v1/completions", completions_body(model, p), False) for p in prompts[:COMPLETIONS]]
    bodies += [("/v1/chat/completions", chat_body(model, p), True) for p in prompts[COMPLETIONS:]]
    before = scrape(server)
    outputs = asyncio.run(benchmark(server.url, bodies))
    after = scrape(server)
    print("one vllm-bench body of each route:", recorder.to("/v1/completions")[0].body.decode(),
          recorder.to("/v1/chat/completions")[0].body.decode(), sep="\n")

    failed = {f"{path}: {out.status} {out.error}" for (path, _, _), out in zip(bodies, outputs) if not out.success}
    assert not failed, "\n".join(sorted(failed))
    for (path, body, _), out in zip(bodies, outputs):
        assert out.done and out.chunks[-1]["choices"] == [] and "usage" in out.chunks[-1], f"{path}: {out.chunks[-1:]}"
        assert out.output_tokens == OUTPUT_LEN, f"{path}: completion_tokens {out.output_tokens} with ignore_eos"
        assert out.prompt_len and out.ttft > 0

    # The completions' text is the greedy answer to the prompt's ids, eos ignored.
    states = greedy_states(package, server.service.session.slots, [codec.encode(p) for p in prompts[:COMPLETIONS]],
                           OUTPUT_LEN, ())
    for i, (out, state) in enumerate(zip(outputs, states)):
        assert_text_is_greedy(out.generated_text, state, codec, [], f"completion {i}")

    (totals_before, positions_before), (totals_after, positions_after) = spec_counters(before), spec_counters(after)
    drafts, draft_tokens, accepted = (totals_after[name] - totals_before[name] for name in SPEC)
    per_position = [positions_after[p] - positions_before[p] for p in range(max(positions_after, default=-1) + 1)]
    width = package.passes["draft"].width
    assert all(name in {n for n, _ in after} for name in SPEC + (PER_POSITION,)), "a spec-decode counter is missing"
    assert drafts > 0 and 0 <= accepted <= draft_tokens <= drafts * width, (drafts, draft_tokens, accepted)
    assert len(per_position) <= width and sum(per_position) == accepted, (per_position, accepted)
    # A draft token is accepted only after every one before it: the counts fall with position.
    assert all(a >= b for a, b in zip([drafts] + per_position, per_position)), (drafts, per_position)
