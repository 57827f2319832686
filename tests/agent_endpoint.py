"""A scripted OpenAI-compatible endpoint on loopback for the agent tests (``http.server`` in a
thread): each POST to ``/v1/chat/completions`` gets the next scripted answer - a reply text, an
HTTP status (429 with Retry-After, 5xx), a raw body, or a delay longer than the client's timeout.
Every request (headers and JSON body) is kept for assertions."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Status:
    code: int
    retry_after: float | None = None


@dataclass(frozen=True)
class Raw:
    body: bytes
    code: int = 200


@dataclass(frozen=True)
class Delay:
    seconds: float


def completion(text: str | None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "scripted",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }  # fmt: skip


@dataclass
class Scripted:
    """The endpoint: ``script`` is consumed in order; ``default`` answers once it is empty."""

    script: list[Any]
    default: Any = "I have no further ideas."
    requests: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next(self) -> Any:
        with self.lock:
            return self.script.pop(0) if self.script else self.default


def _handler(ep: Scripted) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            n = int(self.headers.get("content-length", 0))
            body = json.loads(self.rfile.read(n) or b"{}")
            with ep.lock:
                hdrs = {k.lower(): v for k, v in self.headers.items()}
                ep.requests.append({"path": self.path, "headers": hdrs, "body": body})
            ans = ep.next()
            if isinstance(ans, Delay):
                time.sleep(ans.seconds)
                ans = ep.default
            if isinstance(ans, Status):
                err = {"error": {"message": f"scripted {ans.code}", "type": "x", "code": ans.code}}
                hdr = {} if ans.retry_after is None else {"retry-after": str(ans.retry_after)}
                self._send(ans.code, json.dumps(err).encode(), hdr)
            elif isinstance(ans, Raw):
                self._send(ans.code, ans.body)
            else:
                self._send(200, json.dumps(completion(ans)).encode())

    return Handler


@contextmanager
def serve(script: list[Any], default: Any = "I have no further ideas.") -> Iterator[Scripted]:
    ep = Scripted(list(script), default)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(ep))
    server.daemon_threads = True
    ep.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ep
    finally:
        server.shutdown()
        server.server_close()
