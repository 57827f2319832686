"""Server logging: a request id per HTTP request, in every log record and the response header.

:class:`RequestIdMiddleware` (pure ASGI, so streaming and disconnects pass through untouched)
takes the client's ``x-request-id`` header when it is a sane token, or makes one, keeps it in
the :data:`request_id` context variable for the request's handlers, returns it in the response's
``x-request-id`` header (as vLLM does) and logs one line per request (method, path, status,
milliseconds). :class:`RequestIdFilter` puts the id on every record as ``record.request_id``
(records made off the event loop, by the engine thread, pass it in ``extra``).
:func:`configure_logging` is what ``specpilot serve`` calls; the library itself only logs.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

logger = logging.getLogger("specpilot.server")

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
"""The id of the HTTP request being handled ("-" outside one)."""

HEADER = "x-request-id"
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"
_SANE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def new_request_id(given: str | None = None) -> str:
    """``given`` when it is a token of at most 128 letters, digits and ``._:-``; else a new
    uuid4 hex (a client's odd header never reaches the logs or the response).

    >>> new_request_id("abc-123")
    'abc-123'
    >>> len(new_request_id("bad id\\r\\n"))
    32
    """
    if given and _SANE.fullmatch(given):
        return given
    return uuid.uuid4().hex


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id`` (the current request's, unless the record already has one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get()
        return True


class RequestIdMiddleware:
    """ASGI middleware: the request id in context, in the response header, in the access log."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(HEADER.encode())
        rid = new_request_id(given.decode("latin-1") if given else None)
        token = request_id.set(rid)
        status = [500]
        t0 = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (HEADER.encode(), rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            ms = 1e3 * (time.perf_counter() - t0)
            logger.info("%s %s %d %.1f ms", scope["method"], scope["path"], status[0], ms)
            request_id.reset(token)


def configure_logging(level: str = "info") -> None:
    """Root logging for ``specpilot serve``: one stderr handler, the request id in each line."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not getattr(h, "_specpilot", False)]
    handler._specpilot = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
