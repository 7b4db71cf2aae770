"""What the client tests share: a `b12x serve` that records every exchange, the package's
tokenizer files for clients that want a local one, and the offline references.

The server is the in-process one the other server tests start (tests/http_serving.py), on
a free loopback port, with its ASGI app wrapped by a recorder: each request's method, path,
body and response status (and the response body, to quote when something failed). The
references are the offline engine's: its greedy answers for the same prompt ids, and the
log-probabilities a fresh prefill of the whole sequence gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from b12x_toolchain.runtime.serving.engine import Engine
from b12x_toolchain.runtime.serving.http.server import Server
from b12x_toolchain.runtime.serving.http.service import Service
from b12x_toolchain.runtime.serving.requests import Request
from http_serving import serve_options

ENGINE_PASSES = ("prefill", "verify", "commit", "draft")  # what the server's speculative engine replays


@dataclass
class Exchange:
    method: str
    path: str
    body: bytes = b""
    status: int | None = None
    response: bytes = b""

    def json(self):
        return json.loads(self.body)

    def __str__(self) -> str:
        return f"{self.method} {self.path} -> {self.status}: {self.response.decode(errors='replace')[:600]}"

    @property
    def failed(self) -> bool:
        """A refusal, or an error sent inside a stream that had already answered 200."""
        return self.status != 200 or (self.response.startswith(b"data: ") and b'data: {"error"' in self.response)


class Recorder:
    """An ASGI app around another, keeping every HTTP exchange it passes on."""

    def __init__(self, app):
        self.app, self.exchanges = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        exchange = Exchange(scope["method"], scope["path"])
        self.exchanges.append(exchange)

        async def receiving():
            message = await receive()
            if message["type"] == "http.request":
                exchange.body += message.get("body", b"")
            return message

        async def sending(message):
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body":
                exchange.response += message.get("body", b"")
            await send(message)

        await self.app(scope, receiving, sending)

    def to(self, path: str, method: str = "POST") -> list[Exchange]:
        return [e for e in self.exchanges if e.path == path and e.method == method]

    def failures(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.failed]


def start_recorded_server(package, **options) -> tuple[Server, Recorder]:
    """A server of `package` on a free port of 127.0.0.1 (as http_serving.start_server), recorded."""
    server = Server(Service(serve_options(package, **options)), "127.0.0.1", 0, grace_seconds=5.0)
    recorder = Recorder(server.uvicorn.config.app)
    server.uvicorn.config.app = recorder  # uvicorn loads the app when it starts serving
    return server.start(), recorder


def write_tokenizer(package, folder: Path) -> Path:
    """The package's tokenizer files (as `load` checked them) in `folder`, for a client to load."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in package.tokenizer_files.items():
        (folder / Path(name).name).write_bytes(data)
    return folder


# -- offline references ---------------------------------------------------------------------


def greedy_states(package, slots: int, prompts: list[list[int]], max_new_tokens: int, stop: tuple[int, ...]):
    """The engine's greedy answers to `prompts`, offline, on a session of the server's shape."""
    session = package.session(slots=slots, passes=ENGINE_PASSES)
    return Engine(session).generate([Request(p, max_new_tokens=max_new_tokens, stop=stop) for p in prompts])


def cut_at_stop(text: str, stops: list[str]) -> str:
    """`text` up to the earliest occurrence of any stop string (OpenAI's `stop`)."""
    return text[: min([text.index(s) for s in stops if s in text], default=len(text))]


def assert_text_is_greedy(got: str, state, codec, stops: list[str], label: str) -> None:
    """`got` is the offline answer's text cut at the stop strings, exactly (tests/same_tokens.py)."""
    want = cut_at_stop(codec.decode(state.tokens), stops)
    assert got == want, f"{label}: {got!r} is not the greedy answer {want!r}"


def token_logprobs(session, ids: list[int]) -> torch.Tensor:
    """log p(ids[j] | ids[:j]) for j = 1 .. len(ids)-1, from one fresh prefill of `ids` in slot 0
    of a prefill-only session, chunk by chunk, in float64 from the pass's logits."""
    chunk = session.package.passes["prefill"].width
    session.reset_slot(0)
    rows = []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        out = session.replay("prefill", token_ids=[piece + [0] * (chunk - len(piece))], slot_ids=[0],
                             positions=[start], new_tokens=[len(piece)])
        rows.append(out["logits"][0, : len(piece)].double().log_softmax(-1).cpu())
    logprobs = torch.cat(rows)[:-1]  # position j predicts token j+1
    return logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def continuation_logprob(session, context: list[int], continuation: list[int]) -> float:
    """The sum of log p over the continuation's tokens given the context and what precedes them."""
    return token_logprobs(session, context + continuation)[len(context) - 1 :].sum().item()
