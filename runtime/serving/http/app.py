"""The OpenAI API over a Service: routes, the API key, the body limit, and every error as OpenAI's body.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text). With an API key every route but /health needs
`Authorization: Bearer KEY`. A streamed answer is server-sent events ending in
`data: [DONE]`; a client that disconnects has its request cancelled in the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from b12x_toolchain.runtime.serving.http.codec import AnswerText
from b12x_toolchain.runtime.serving.http.engine_loop import Ticket, Update
from b12x_toolchain.runtime.serving.http.errors import APIError, bad_request
from b12x_toolchain.runtime.serving.http.protocol import Generation, parse
from b12x_toolchain.runtime.serving.http.responses import Shaper, sse, usage

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def create_app(service) -> FastAPI:
    app = FastAPI(title="b12x", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = service.metrics

    def refuse(error: APIError) -> JSONResponse:
        metrics.refused.labels(str(error.status)).inc()
        return error_response(error)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return refuse(error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return refuse(APIError(exc.status_code, str(exc.detail), kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        # No traceback leaves the server: the client gets the error's type and message.
        return refuse(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    def authorize(request: Request) -> None:
        key = service.options.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer KEY", "authentication_error",
                           code="invalid_api_key")

    async def read_json(request: Request):
        limit = service.options.max_body_bytes
        too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                             code="request_too_large")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None

    @app.get("/health")
    async def health():
        if not service.loop.admitting or service.loop.failure is not None:
            return JSONResponse({"status": "draining" if service.loop.failure is None else "failed"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(request: Request):
        authorize(request)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        card = {"id": service.model_name, "object": "model", "created": int(service.started), "owned_by": "b12x",
                "max_model_len": service.limits.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool):
        arrived = time.perf_counter()
        authorize(request)
        body = await read_json(request)
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        generation = parse(body, chat, service.codec, service.limits, request_id)
        model = body.get("model")
        if model is not None and model != service.model_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves {service.model_name!r}",
                           "not_found_error", "model", "model_not_found")
        ticket = Ticket(request_id, arrived)
        service.loop.submit(generation.request, ticket)
        shaper = Shaper(request_id, service.model_name, chat)
        text = AnswerText(service.codec, generation.stop_strings) if generation.text else None
        if generation.stream:
            # The status line waits for the first tokens, so a request the engine refuses gets its code.
            first = await watched_update(request, ticket, text)
            if first is None:
                return Response(status_code=499)  # nobody reads it: the client is gone
            return StreamingResponse(stream(generation, ticket, shaper, text, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(request, ticket, shaper, text)

    async def next_update(ticket: Ticket, text: AnswerText | None) -> tuple[Update, str, list[int]]:
        """The next update, its new text and the answer's ids in it; a stop string found in it
        cancels the request."""
        update = await ticket.updates.get()
        if update.error is not None:
            raise update.error
        if text is None:
            return update, "", update.tokens
        piece, ids = text.push(update.tokens)
        if text.stopped and update.finish_reason is None:
            service.loop.cancel(ticket.id, outcome="stop")
        if update.finish_reason is not None:
            piece += text.finish()
        return update, piece, ids

    def finish_reason(update: Update, text: AnswerText | None) -> str:
        return "stop" if text is not None and text.stopped else update.finish_reason

    async def watched_update(request: Request, ticket: Ticket, text: AnswerText | None):
        """next_update, watching the client meanwhile: None, its request cancelled, once it has gone."""
        while True:
            try:
                return await asyncio.wait_for(next_update(ticket, text), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    service.loop.cancel(ticket.id)
                    return None

    async def collect(request: Request, ticket: Ticket, shaper: Shaper, text: AnswerText | None):
        pieces, ids = [], []
        while True:
            got = await watched_update(request, ticket, text)
            if got is None:
                return Response(status_code=499)  # nobody reads it: the client is gone
            update, piece, answer = got
            pieces.append(piece)
            ids += answer
            if update.finish_reason is not None:
                break
        use = usage(update.prompt_tokens, update.completion_tokens, update.cached_tokens)
        return shaper.response("".join(pieces), ids, finish_reason(update, text), use)

    async def stream(generation: Generation, ticket: Ticket, shaper: Shaper, text: AnswerText | None, first):
        finished, opening = False, True
        update, piece, answer = first
        try:
            while True:
                if answer or piece or opening:
                    yield sse(shaper.chunk(piece, answer, role=opening))
                    opening = False
                if update.finish_reason is not None:
                    finished = True
                    yield sse(shaper.chunk("", [], finish_reason(update, text)))
                    if generation.include_usage:
                        yield sse(shaper.usage_chunk(usage(update.prompt_tokens, update.completion_tokens,
                                                           update.cached_tokens)))
                    break
                try:
                    update, piece, answer = await next_update(ticket, text)
                except APIError as error:  # the engine failed mid-stream, long after the status line
                    metrics.refused.labels(str(error.status)).inc()
                    finished = True
                    yield sse(error.body())
                    break
            yield sse("[DONE]")
        finally:
            if not finished:  # the client went away mid-stream: its slot and pages go back now
                service.loop.cancel(ticket.id)

    return app
