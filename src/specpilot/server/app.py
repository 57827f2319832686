"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, metrics.

Request bodies are the pydantic models of :mod:`.protocol` (FastAPI validates them; a
validation error becomes the OpenAI error body). Streaming responses are server-sent events
(``data: {chunk}\\n\\n`` ... ``data: [DONE]``), the format the official ``openai`` client reads.
A client that disconnects mid-request is cancelled: its sequence leaves the batch at the next
step. Errors use the OpenAI body ``{"error": {"message", "type", "param", "code"}}``; a request
the engine thread fails (or that outlives the engine thread) gets a 500 of that shape. Every
request has an id (:mod:`.logs`): in the ``x-request-id`` response header and its log lines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from specpilot import __version__
from specpilot.engine import GenerationConfig, GenerationResult
from specpilot.errors import SpecPilotError
from specpilot.server.logs import RequestIdMiddleware, request_id
from specpilot.server.protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    GenRequest,
    parse_body,
    validation_error,
)
from specpilot.server.scheduler import Event, Job, Scheduler
from specpilot.tokenizer import StreamDecoder, Tokenizer

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
DISCONNECT_POLL_S = 0.5
ENGINE_GONE = "the engine thread is not running"

logger = logging.getLogger(__name__)
Body = TypeVar("Body", bound=BaseModel)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class _StopTrim:
    """Holds back text that might be the start of a stop string; cuts at the first stop."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.keep = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, piece: str, final: bool) -> str:
        self.text += piece
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        end = cut if cut >= 0 else (len(self.text) if final else len(self.text) - self.keep)
        out = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out


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
    """The app; its lifespan starts and stops the scheduler's worker thread."""

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
    max_new = context_len - 1

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(e.errors())
        logger.info("rejected: %s (param %s)", err.message, err.param)
        return _error(err)

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

    def _checked(body: CompletionRequest | ChatRequest) -> GenRequest:
        req = body.to_gen(max_new)
        if req.model != model_name:
            raise APIError(
                404,
                f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                "model",
                "model_not_found",
            )
        return req

    def _encode(req: GenRequest) -> list[int]:
        try:
            if req.messages is not None:
                return tokenizer.encode(tokenizer.apply_chat_template(list(req.messages)))
            if isinstance(req.prompt, list):
                vocab = scheduler.engine.model.cfg.vocab_size
                if any(not 0 <= t < vocab for t in req.prompt):
                    raise APIError(400, f"token ids must be in [0, {vocab})", "prompt")
                return list(req.prompt)
            return tokenizer.encode(req.prompt)
        except SpecPilotError as e:
            raise APIError(400, str(e), "messages" if req.chat else "prompt") from None

    def _gen(req: GenRequest, n_prompt: int) -> GenerationConfig:
        param = "messages" if req.chat else "prompt"
        room = context_len - n_prompt - scheduler.spec.max_nodes - 2
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {n_prompt} tokens; this model's context is {context_len}",
                param,
                "context_length_exceeded",
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else room
        try:
            return GenerationConfig(
                max_new_tokens=max_tokens,
                stop_strings=req.stop,
                temperature=req.temperature,
                top_k=req.top_k,
                top_p=req.top_p,
                seed=req.seed,
            )
        except SpecPilotError as e:
            raise APIError(400, str(e)) from None

    def _submit(req: GenRequest, ids: list[int]) -> Job:
        job = Job(ids, _gen(req, len(ids)), asyncio.get_running_loop())
        job.request_id = request_id.get()
        try:
            scheduler.submit(job)
        except SpecPilotError as e:
            param = "messages" if req.chat else "prompt"
            raise APIError(400, str(e), param, "context_length_exceeded") from None
        return job

    async def _next_event(request: Request, job: Job, watch_client: bool = True) -> Event:
        """The job's next event; an error event when the engine thread is gone (the request
        would otherwise wait forever); 499 when the client left (``watch_client``: a stream
        learns that from its response instead)."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if not scheduler.alive and job.events.empty():
                    logger.error("request failed: %s", ENGINE_GONE)
                    return Event("error", error=ENGINE_GONE)
                if watch_client and await request.is_disconnected():
                    scheduler.cancel(job)
                    raise APIError(499, "client closed the request") from None

    async def _collect(request: Request, job: Job) -> GenerationResult:
        while True:
            ev = await _next_event(request, job)
            if ev.kind == "error":
                raise APIError(500, ev.error, type="server_error")
            if ev.kind == "done":
                assert ev.result is not None
                return ev.result

    def _usage(n_prompt: int, res_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": res_tokens,
            "total_tokens": n_prompt + res_tokens,
        }

    def _text(res: GenerationResult, stops: tuple[str, ...]) -> str:
        trim = _StopTrim(stops)
        return trim.push(tokenizer.decode(res.tokens), final=True)

    async def _handle(request: Request, body: CompletionRequest | ChatRequest) -> Response:
        chat = isinstance(body, ChatRequest)
        req = _checked(body)
        ids = _encode(req)
        job = _submit(req, ids)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if req.stream:
            return StreamingResponse(
                _stream(request, req, job, rid, len(ids)), media_type="text/event-stream"
            )
        try:
            res = await _collect(request, job)
        finally:
            scheduler.cancel(job)  # no-op for a finished job
        text = _text(res, req.stop)
        finish = FINISH[res.stop_reason]
        base = {"id": rid, "created": int(time.time()), "model": model_name}
        usage = _usage(len(ids), len(res.tokens))
        if chat:
            msg = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}
            return JSONResponse(
                {**base, "object": "chat.completion", "choices": [choice], "usage": usage}
            )
        if req.echo and isinstance(req.prompt, str):
            text = req.prompt + text
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return JSONResponse(
            {**base, "object": "text_completion", "choices": [choice], "usage": usage}
        )

    async def _stream(
        request: Request, req: GenRequest, job: Job, rid: str, n_prompt: int
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        base = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name}

        def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
            if req.chat:
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if text is not None:
                    delta["content"] = text
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
                choice["logprobs"] = None
            return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

        dec, trim = StreamDecoder(tokenizer), _StopTrim(req.stop)
        try:
            if req.chat:
                yield chunk("", None, first=True)
            elif req.echo and isinstance(req.prompt, str):
                yield chunk(req.prompt, None)
            while True:
                ev = await _next_event(request, job, watch_client=False)
                if ev.kind == "error":
                    err = APIError(500, ev.error, type="server_error")
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                if ev.kind == "tokens":
                    piece = trim.push(dec.push(ev.tokens), final=False)
                    if piece:
                        yield chunk(piece, None)
                    continue
                assert ev.result is not None
                piece = trim.push(dec.flush(), final=True)
                if piece:
                    yield chunk(piece, None)
                yield chunk(None if req.chat else "", FINISH[ev.result.stop_reason])
                if req.include_usage:
                    usage = _usage(n_prompt, len(ev.result.tokens))
                    yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
                break
            yield "data: [DONE]\n\n"
        finally:  # finished, or the client went away (the generator is closed / cancelled)
            scheduler.cancel(job)

    @app.post("/v1/completions", openapi_extra=_schema(CompletionRequest))
    async def completions(request: Request, body: CompletionBody) -> Response:
        return await _handle(request, body)

    @app.post("/v1/chat/completions", openapi_extra=_schema(ChatRequest))
    async def chat_completions(request: Request, body: ChatBody) -> Response:
        return await _handle(request, body)

    return app
