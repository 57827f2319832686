"""One completion or chat request from validated body to response (the routes of :mod:`.app`).

:class:`Completions` checks the model name, encodes the prompt or the chat messages, sizes the
generation to the context, submits a :class:`~specpilot.server.scheduler.Job` and waits for its
events: the whole result as one OpenAI body, or a server-sent event per new piece of text
(``data: {chunk}\\n\\n`` ... ``data: [DONE]``). Stop strings are cut on the decoded text
(:class:`StopTrim`). A request the engine thread fails gets a 500 OpenAI error body (a final
error event on a stream); so does one still waiting when the engine thread is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specpilot.engine import GenerationConfig, GenerationResult
from specpilot.errors import SpecPilotError
from specpilot.server.logs import request_id
from specpilot.server.protocol import APIError, ChatRequest, CompletionRequest, GenRequest
from specpilot.server.scheduler import Event, Job, Scheduler
from specpilot.tokenizer import StreamDecoder, Tokenizer

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
DISCONNECT_POLL_S = 0.5
ENGINE_GONE = "the engine thread is not running"

logger = logging.getLogger(__name__)


class StopTrim:
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


def usage(n_prompt: int, n_completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_completion,
        "total_tokens": n_prompt + n_completion,
    }


class Completions:
    """Serves ``/v1/completions`` and ``/v1/chat/completions`` for one model."""

    def __init__(
        self, scheduler: Scheduler, tokenizer: Tokenizer, model_name: str, context_len: int
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context_len = context_len

    async def handle(self, request: Request, body: CompletionRequest | ChatRequest) -> Response:
        chat = isinstance(body, ChatRequest)
        req = self.checked(body)
        ids = self.encode(req)
        job = self.submit(req, ids)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if req.stream:
            return StreamingResponse(
                self.stream(request, req, job, rid, len(ids)), media_type="text/event-stream"
            )
        try:
            res = await self.collect(request, job)
        finally:
            self.scheduler.cancel(job)  # no-op for a finished job
        return JSONResponse(self.body(req, res, rid, len(ids)))

    def checked(self, body: CompletionRequest | ChatRequest) -> GenRequest:
        req = body.to_gen(self.context_len - 1)
        if req.model != self.model_name:
            raise APIError(
                404,
                f"the model '{req.model}' does not exist; this server serves '{self.model_name}'",
                "model",
                "model_not_found",
            )
        return req

    def encode(self, req: GenRequest) -> list[int]:
        tok = self.tokenizer
        try:
            if req.messages is not None:
                return tok.encode(tok.apply_chat_template(list(req.messages)))
            if isinstance(req.prompt, list):
                vocab = self.scheduler.engine.model.cfg.vocab_size
                if any(not 0 <= t < vocab for t in req.prompt):
                    raise APIError(400, f"token ids must be in [0, {vocab})", "prompt")
                return list(req.prompt)
            return tok.encode(req.prompt)
        except SpecPilotError as e:
            raise APIError(400, str(e), "messages" if req.chat else "prompt") from None

    def generation(self, req: GenRequest, n_prompt: int) -> GenerationConfig:
        param = "messages" if req.chat else "prompt"
        room = self.context_len - n_prompt - self.scheduler.spec.max_nodes - 2
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {n_prompt} tokens; this model's context is {self.context_len}",
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

    def submit(self, req: GenRequest, ids: list[int]) -> Job:
        job = Job(ids, self.generation(req, len(ids)), asyncio.get_running_loop())
        job.request_id = request_id.get()
        try:
            self.scheduler.submit(job)
        except SpecPilotError as e:
            param = "messages" if req.chat else "prompt"
            raise APIError(400, str(e), param, "context_length_exceeded") from None
        return job

    async def next_event(self, request: Request, job: Job, watch_client: bool = True) -> Event:
        """The job's next event; an error event when the engine thread is gone (the request
        would otherwise wait forever); 499 when the client left (``watch_client``: a stream
        learns that from its response instead)."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if not self.scheduler.alive and job.events.empty():
                    logger.error("request failed: %s", ENGINE_GONE)
                    return Event("error", error=ENGINE_GONE)
                if watch_client and await request.is_disconnected():
                    self.scheduler.cancel(job)
                    raise APIError(499, "client closed the request") from None

    async def collect(self, request: Request, job: Job) -> GenerationResult:
        while True:
            ev = await self.next_event(request, job)
            if ev.kind == "error":
                raise APIError(500, ev.error, type="server_error")
            if ev.kind == "done":
                assert ev.result is not None
                return ev.result

    def body(self, req: GenRequest, res: GenerationResult, rid: str, n_prompt: int) -> Any:
        """The OpenAI body of a finished non-streaming request."""
        text = StopTrim(req.stop).push(self.tokenizer.decode(res.tokens), final=True)
        finish = FINISH[res.stop_reason]
        base = {"id": rid, "created": int(time.time()), "model": self.model_name}
        use = usage(n_prompt, len(res.tokens))
        if req.chat:
            msg = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}
            return {**base, "object": "chat.completion", "choices": [choice], "usage": use}
        if req.echo and isinstance(req.prompt, str):
            text = req.prompt + text
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {**base, "object": "text_completion", "choices": [choice], "usage": use}

    async def stream(
        self, request: Request, req: GenRequest, job: Job, rid: str, n_prompt: int
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        base = {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}

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

        dec, trim = StreamDecoder(self.tokenizer), StopTrim(req.stop)
        try:
            if req.chat:
                yield chunk("", None, first=True)
            elif req.echo and isinstance(req.prompt, str):
                yield chunk(req.prompt, None)
            while True:
                ev = await self.next_event(request, job, watch_client=False)
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
                    use = usage(n_prompt, len(ev.result.tokens))
                    yield f"data: {json.dumps({**base, 'choices': [], 'usage': use})}\n\n"
                break
            yield "data: [DONE]\n\n"
        finally:  # finished, or the client went away (the generator is closed / cancelled)
            self.scheduler.cancel(job)
