"""The HTTP side of `lab.serving`: the FastAPI application (OpenAI's routes, server-sent
events by sse-starlette) and `serve`, which runs it on uvicorn. Imported by the `role=serve`
roles only: a run that does not serve never loads the web stack."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from lab.config import is_loopback
from lab.serving import (
    DISCONNECT_POLL_S,
    SUMMARY_S,
    ApiError,
    Engine,
    Params,
    ServeConfig,
    Server,
    Text,
)

log = logging.getLogger("lab.serving")


def finish_reason(tokens: list[int], text: Text, params: Params) -> str:
    """OpenAI's: `stop` at the end of text or a stop string, `length` at max_tokens."""
    if text.stopped or (text.eos is not None and text.eos in tokens[: params.max_new_tokens]):
        return "stop"
    return "length" if len(tokens) >= params.max_new_tokens else "stop"


def build_app(server: Server) -> Any:
    """The FastAPI application over `server` (no OpenAPI pages: the OpenAI reference is)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        async def summaries() -> None:  # the periodic summary beside the per-request lines
            while True:
                await asyncio.sleep(SUMMARY_S)
                line = server.summary.line(generating=server.generating, waiting=server.waiting)
                if line is not None:
                    log.info("%s", line)

        task = asyncio.create_task(summaries())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(
        title="distributed-llm-lab",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan,
    )

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:  # 404, 405
        error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        return JSONResponse(error.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        error = ApiError(500, "the server failed on this request: see its log", kind="server_error")
        return JSONResponse(error.body(), status_code=500)

    async def read_body(request: Request) -> dict[str, Any]:
        """The JSON object of a request, its size checked before it is read (and as it comes)."""
        limit = server.config.max_body_kib * 1024
        too_big = ApiError(413, f"the body is over serve.max_body_kib={server.config.max_body_kib}")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise too_big
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise too_big
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        server.check_key(request.headers.get("authorization"))
        entry = {"id": server.model_id, "object": "model", "created": 0, "owned_by": "lab"}
        return JSONResponse({"object": "list", "data": [entry]})

    @app.get("/health")
    async def health(request: Request) -> Response:
        server.check_key(request.headers.get("authorization"))
        engine = await asyncio.get_running_loop().run_in_executor(None, server.engine.health)
        return JSONResponse(
            {
                "status": "ok",
                "generating": server.generating,
                "waiting": server.waiting,
                "served": server.served,
                "cancelled": server.cancelled,
                # CPU seconds so far (compare two readings): this event loop's thread (HTTP,
                # server-sent events; its start-up included), the requests' worker threads
                "cpu_s": {
                    "event_loop": time.thread_time(),
                    "requests": server.request_cpu_s,
                    "process": time.process_time(),
                },
                "engine": engine,
            }
        )

    async def complete(request: Request, *, chat: bool) -> Response:
        server.check_key(request.headers.get("authorization"))
        body = await read_body(request)
        params, stops = server.params(body), server.stops(body)
        prompt = server.prompt_ids(body, chat=chat, max_new_tokens=params.max_new_tokens)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, f"stream={stream!r} must be true or false", param="stream")
        kind = "chat.completion" if chat else "text_completion"
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{next(server.ids)}"
        created = int(time.time())
        text = Text(server.tokenizer, stops, server.tokenizer.eos_token_id)

        def reply(tokens: list[int]) -> dict[str, Any]:
            tokens = tokens[: params.max_new_tokens]
            content, reason = text.text(tokens), finish_reason(tokens, text, params)
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": content}
            else:
                choice["text"] = content
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(tokens),
                "total_tokens": len(prompt) + len(tokens),
            }
            return {
                "id": request_id,
                "object": kind,
                "created": created,
                "model": server.model_id,
                "choices": [choice],
                "usage": usage,
            }

        def chunk(piece: str, reason: str | None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
            if chat:
                choice["delta"] = {"content": piece} if piece or reason else {"role": "assistant"}
            else:
                choice["text"] = piece
            return json.dumps(
                {
                    "id": request_id,
                    "created": created,
                    "model": server.model_id,
                    "object": f"{kind}.chunk" if chat else kind,
                    "choices": [choice],
                }
            )

        def result(future: asyncio.Future[list[int]]) -> list[int]:
            try:
                return future.result()
            except Exception as exc:
                log.error("request %s failed: %s: %s", request_id, type(exc).__name__, exc)
                raise ApiError(503, f"generation failed: {exc}", kind="server_error") from None

        if not await server.take_slot(request_id, request.is_disconnected):
            return Response(status_code=499)  # nobody is there to read it
        pieces: asyncio.Queue[str | None] | None = asyncio.Queue() if stream else None
        future, cancel = server.start(request_id, prompt, params, text, pieces)
        server.served += 1
        if pieces is None:
            try:
                while not future.done():
                    await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
                    if not future.done() and await request.is_disconnected():
                        cancel.set()
            finally:
                cancel.set()  # cancelled itself (the server stopping): the generation too
            return JSONResponse(reply(result(future)))

        queue = pieces
        future.add_done_callback(lambda _: queue.put_nowait(None))

        async def events() -> Any:
            try:
                if chat:
                    yield chunk("", None)
                while (piece := await queue.get()) is not None:
                    yield chunk(piece, None)
                try:
                    tokens = result(future)[: params.max_new_tokens]
                except ApiError as exc:
                    yield json.dumps(exc.body())
                    return
                whole = text.text(tokens)
                yield chunk(whole[len(text.sent) :], finish_reason(tokens, text, params))
                yield "[DONE]"
            finally:
                cancel.set()  # a client that went away: the generation stops at its next token

        return EventSourceResponse(events(), ping=15)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    return app


def serve(
    engine: Engine, tokenizer: Any, *, model_id: str, config: ServeConfig, secret: bytes | None
) -> None:
    """Answer OpenAI API requests with `engine` until SIGINT or SIGTERM."""
    server = Server(engine, tokenizer, model_id=model_id, config=config, secret=secret)
    if getattr(tokenizer, "chat_template", None) is None:
        log.warning(
            "%s's tokenizer has no chat template: /v1/chat/completions writes each message as "
            "a `role: content` line and ends with `assistant:`",
            model_id,
        )
    if secret is None:
        where = "any local user" if is_loopback(config.host) else "anyone who reaches it"
        log.warning(
            "no secret is set: %s can call the endpoint at %s:%d. Set LAB_SECRET (or "
            "cluster.secret_file): clients then give it as their API key",
            where,
            config.host,
            config.port,
        )
    app = build_app(server)
    listener = _listen(config.host, config.port)  # bound before it says so: a client may call
    print(f"serving {model_id} at http://{config.host}:{config.port}/v1", flush=True)
    settings = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        limit_concurrency=config.max_queue + 64,  # connections beyond: 503 at once
        timeout_graceful_shutdown=5,
    )
    try:
        uvicorn.Server(settings).run(sockets=[listener])
    finally:
        server.stop()
        listener.close()


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket at host:port, or one line saying why not (a ConfigError)."""
    from lab.cli import ConfigError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen at serve.host={host} serve.port={port}: {exc.strerror or exc}"
        ) from None
    return listener
