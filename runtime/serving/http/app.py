"""The OpenAI API over a Service: routes, the API key, the body limits, and every error as OpenAI's body.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize,
POST /detokenize, GET /tokenizer_info, GET /health, GET /metrics (Prometheus text) and
GET /openapi.json. With an API key every route but /health needs `Authorization: Bearer
KEY`. A streamed answer is server-sent events ending in `data: [DONE]`; a client that
disconnects has its request cancelled in the engine. An `X-Request-Id` header comes back
on the response (one is made when the client sends none).

No exception leaves a route: whatever one raises becomes an OpenAI error body with its
status, so the connection stays open for the client's next request.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from b12x_toolchain.runtime.serving.http import schemas
from b12x_toolchain.runtime.serving.http.body import read_json
from b12x_toolchain.runtime.serving.http.choices import Answer, Delta
from b12x_toolchain.runtime.serving.http.engine_loop import Ticket
from b12x_toolchain.runtime.serving.http.errors import APIError
from b12x_toolchain.runtime.serving.http.protocol import Generation, parse
from b12x_toolchain.runtime.serving.http.responses import Shaper, join, sse
from b12x_toolchain.runtime.serving.http.tokenize import detokenize, tokenize, tokenizer_info

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # a client's X-Request-Id: printable ASCII, bounded


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def create_app(service) -> FastAPI:
    app = FastAPI(title="b12x", version="1", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.service = service
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for method, path, route, schema in ROUTES:
        app.add_api_route(path, guarded(route), methods=[method], openapi_extra=schema)
    return app


def service_of(request: Request):
    return request.app.state.service


def refuse(request: Request, error: APIError) -> JSONResponse:
    service_of(request).metrics.refused.labels(str(error.status)).inc()
    return error_response(error)


async def api_error(request: Request, error: APIError):
    return refuse(request, error)


async def http_error(request: Request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return refuse(request, APIError(exc.status_code, str(exc.detail), kind))


def guarded(route):
    """No exception leaves the route: Starlette answers one that does with a 500 and then
    closes the connection, dropping whatever the client sent behind it."""
    @functools.wraps(route)
    async def run(request: Request):
        try:
            return await route(request)
        except APIError as error:
            return refuse(request, error)
        except Exception as exc:  # no traceback leaves the server: the client gets type and message
            return refuse(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))
    return run


def authorize(request: Request) -> None:
    key = service_of(request).options.api_key
    if key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise APIError(401, "missing or wrong API key: send Authorization: Bearer KEY", "authentication_error",
                       code="invalid_api_key")


async def body_of(request: Request):
    authorize(request)
    options = service_of(request).options
    return await read_json(request, options.max_body_bytes, options.body_timeout_s)


# -- routes ---------------------------------------------------------------------------------

async def health(request: Request):
    loop = service_of(request).loop
    if not loop.admitting or loop.failure is not None:
        return JSONResponse({"status": "draining" if loop.failure is None else "failed"}, status_code=503)
    return {"status": "ok"}


async def prometheus(request: Request):
    authorize(request)
    body, content_type = service_of(request).metrics.render()
    return Response(body, media_type=content_type)


async def models(request: Request):
    authorize(request)
    service = service_of(request)
    card = {"id": service.model_name, "object": "model", "created": int(service.started), "owned_by": "b12x",
            "max_model_len": service.limits.max_seq_len}
    return {"object": "list", "data": [card]}


async def tokenize_route(request: Request):
    service = service_of(request)
    return tokenize(await body_of(request), service.codec, service.limits)


async def detokenize_route(request: Request):
    return detokenize(await body_of(request), service_of(request).codec)


async def tokenizer_info_route(request: Request):
    authorize(request)
    service = service_of(request)
    return tokenizer_info(service.codec, service.limits)


async def completions(request: Request):
    return await generate(request, chat=False)


async def chat_completions(request: Request):
    return await generate(request, chat=True)


async def generate(request: Request, chat: bool):
    arrived = time.perf_counter()
    service = service_of(request)
    body = await body_of(request)
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    client_id = request.headers.get("x-request-id")
    headers = {"X-Request-Id": client_id if client_id and REQUEST_ID.fullmatch(client_id) else request_id}
    generation = parse(body, chat, service.codec, service.limits, request_id)
    model = body.get("model")
    if model is not None and model != service.model_name:
        raise APIError(404, f"model {model!r} is not served here; this server serves {service.model_name!r}",
                       "not_found_error", "model", "model_not_found")
    updates = asyncio.Queue()
    tickets = [Ticket(r.id, arrived, i, updates) for i, r in enumerate(generation.requests)]
    service.loop.submit(generation.requests, tickets)
    run = Run(service.loop, tickets, Answer(generation, service.codec))
    shaper = Shaper(request_id, service.model_name, chat)
    if generation.stream:
        # The status line waits for the first tokens, so a request the engine refuses gets its code.
        first = await run.watched(request)
        if first is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        return StreamingResponse(stream(generation, run, shaper, first, service.metrics),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"} | headers)
    return JSONResponse(await collect(request, run, shaper), headers=headers)


async def collect(request: Request, run: "Run", shaper: Shaper):
    deltas: list[list[Delta]] = [[] for _ in run.tickets]
    try:
        while not run.answer.finished:
            delta = await run.watched(request)
            if delta is None:
                return Response(status_code=499)  # nobody reads it: the client is gone
            deltas[delta.index].append(delta)
    finally:
        run.cancel_unfinished()
    return shaper.response([join(d, i) for i, d in enumerate(deltas)], run.answer.usage())


async def stream(generation: Generation, run: "Run", shaper: Shaper, first: Delta, metrics):
    opened, delta = set(), first
    try:
        while True:
            if delta.text or delta.token_ids or delta.logprobs or delta.finish_reason or delta.index not in opened:
                use = run.answer.usage() if generation.continuous_usage else None
                yield sse(shaper.chunk(delta, role=delta.index not in opened, use=use))
                opened.add(delta.index)
            if run.answer.finished:
                if generation.include_usage:
                    yield sse(shaper.usage_chunk(run.answer.usage()))
                break
            try:
                delta = await run.next()
            except APIError as error:  # the engine failed mid-stream, long after the status line
                metrics.refused.labels(str(error.status)).inc()
                yield sse(error.body())
                break
        yield sse("[DONE]")
    finally:
        run.cancel_unfinished()  # a client gone mid-stream, or a choice failed: slots and pages go back now


ROUTES = (  # method, path, route, the request body's schema in /openapi.json
    ("GET", "/health", health, None),
    ("GET", "/metrics", prometheus, None),
    ("GET", "/v1/models", models, None),
    ("POST", "/tokenize", tokenize_route, schemas.TOKENIZE),
    ("POST", "/detokenize", detokenize_route, schemas.DETOKENIZE),
    ("GET", "/tokenizer_info", tokenizer_info_route, None),
    ("POST", "/v1/completions", completions, schemas.COMPLETION),
    ("POST", "/v1/chat/completions", chat_completions, schemas.CHAT),
)


class Run:
    """One request's choices in the engine: the next delta of any of them, as its updates come."""

    def __init__(self, loop, tickets: list[Ticket], answer: Answer):
        self.loop, self.tickets, self.answer = loop, tickets, answer

    async def next(self) -> Delta:
        update = await self.tickets[0].updates.get()  # the queue all of them share
        if update.error is not None:
            raise update.error
        ticket = self.tickets[update.index]
        return self.answer.choices[update.index].push(update, lambda: self.loop.cancel(ticket.id, outcome="stop"))

    async def watched(self, request: Request) -> Delta | None:
        """next(), watching the client meanwhile: None, every choice cancelled, once it has gone."""
        while True:
            try:
                return await asyncio.wait_for(self.next(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.cancel_unfinished()
                    return None

    def cancel_unfinished(self) -> None:
        for ticket, choice in zip(self.tickets, self.answer.choices):
            if choice.finish_reason is None:
                self.loop.cancel(ticket.id)
