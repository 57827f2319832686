"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, metrics.

Request bodies are the pydantic models of :mod:`.protocol`, read by a FastAPI dependency (a
validation error becomes the OpenAI error body); :mod:`.completions` serves them. Streaming
responses are server-sent events (``data: {chunk}\\n\\n`` ... ``data: [DONE]``), the format the
official ``openai`` client reads. A client that disconnects mid-request is cancelled: its
sequence leaves the batch at the next step. Errors use the OpenAI body
``{"error": {"message", "type", "param", "code"}}``; a request the engine thread fails (or that
outlives the engine thread) gets a 500 of that shape. Every request has an id (:mod:`.logs`):
in the ``x-request-id`` response header and its log lines.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from specpilot import __version__
from specpilot.errors import ConfigError, SpecPilotError
from specpilot.server.completions import ENGINE_GONE, Completions
from specpilot.server.logs import RequestIdMiddleware
from specpilot.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    parse_body,
    validation_error,
)
from specpilot.server.scheduler import Scheduler
from specpilot.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
Body = TypeVar("Body", bound=BaseModel)


def _error(e: APIError) -> JSONResponse:
    if e.status < 500:
        logger.info("rejected (%d): %s (param %s)", e.status, e.message, e.param)
    else:
        logger.error("failed (%d): %s", e.status, e.message)
    return JSONResponse(e.body(), status_code=e.status)


def _body(model: type[Body]) -> Callable[[Request], Awaitable[Body]]:
    """A FastAPI dependency: the request body validated as ``model``. The body is read as JSON
    whatever its content type says (as this server always has; FastAPI's own body parameters
    would refuse a JSON body sent without ``application/json``)."""

    async def read(request: Request) -> Body:
        return parse_body(model, await request.body())

    return read


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI request body of a route whose body comes from :func:`_body`."""
    schema = {"schema": model.model_json_schema()}
    return {"requestBody": {"required": True, "content": {"application/json": schema}}}


CompletionBody = Annotated[CompletionRequest, Depends(_body(CompletionRequest))]
ChatBody = Annotated[ChatRequest, Depends(_body(ChatRequest))]


def create_app(
    scheduler: Scheduler,
    tokenizer: Tokenizer,
    model_name: str,
    context_len: int,
) -> FastAPI:
    """The app; its lifespan starts the scheduler's worker thread (if it runs one) and stops the
    scheduler."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="specpilot", version=__version__, lifespan=lifespan)
    app.add_middleware(RequestIdMiddleware)
    created = int(time.time())
    serve = Completions(scheduler, tokenizer, model_name, context_len)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error(validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if e.status_code == 404 else None
        return _error(APIError(e.status_code, str(e.detail), code=code))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if not scheduler.alive:
            raise APIError(503, ENGINE_GONE, type="server_error")
        eng = scheduler.engine
        return {"status": "ok", "running": len(eng.slots), "max_batch": eng.bcfg.max_batch}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(scheduler.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "specpilot"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", openapi_extra=_schema(CompletionRequest))
    async def completions(request: Request, body: CompletionBody) -> Response:
        return await serve.handle(request, body)

    @app.post("/v1/chat/completions", openapi_extra=_schema(ChatRequest))
    async def chat_completions(request: Request, body: ChatBody) -> Response:
        return await serve.handle(request, body)

    return app


def serve_in_main(scheduler: Scheduler, server: Any) -> None:
    """Serve until SIGINT or SIGTERM: the engine (``scheduler``, made with ``own_thread=False``)
    in this thread, the process's main thread, which loaded the model; ``server`` (a
    ``uvicorn.Server`` over :func:`create_app` of ``scheduler``) in a thread of its own, where
    uvicorn installs no signal handlers (why the engine stays here: :mod:`.scheduler`). A signal
    starts uvicorn's graceful shutdown (a second one forces it); the engine keeps stepping until
    the app's lifespan stops it, so requests in flight finish. ConfigError if the server did not
    start (a taken port: uvicorn logged why); SpecPilotError if it stopped without a signal or
    the scheduler being stopped (a crash in its thread)."""

    def http() -> None:
        try:
            server.run()
        except SystemExit:  # uvicorn's exit when it cannot start (it logged why)
            pass
        except Exception:
            logger.exception("the HTTP server failed")

    web = threading.Thread(target=http, name="specpilot-http", daemon=True)
    asked: list[int] = []  # the signals received

    def leave(signum: int, frame: Any) -> None:
        asked.append(signum)
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    handlers = {sig: signal.signal(sig, leave) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        web.start()
        scheduler.run(until=lambda: not web.is_alive())
    finally:
        server.should_exit = True
        web.join(30)
        for sig, old in handlers.items():
            signal.signal(sig, old)
    if not server.started:
        host, port = server.config.host, server.config.port
        raise ConfigError(f"the HTTP server could not start on {host}:{port} (see the log above)")
    if not asked and not scheduler.stopped:
        raise SpecPilotError("the HTTP server stopped on its own (see the log above)")
