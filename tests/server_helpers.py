"""Server tests' helpers: the tiny batched engine they serve, and an ASGI app run with uvicorn on
a free loopback port in a daemon thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from specpilot.batch import BatchConfig, BatchEngine
from specpilot.engine import EngineConfig
from specpilot.tokenizer import Tokenizer

from .conftest import tiny_model
from .test_tokenizer import tiny_tokenizer

CTX = 200
"""Context length of the served engine (cache slots per sequence, one more is scratch)."""


def tiny_served(max_batch: int = 4) -> tuple[Tokenizer, BatchEngine]:
    """The tokenizer and a batched engine over the tiny seeded model the server tests serve
    (``tiny_model("llama", seed=7)``: an ``Engine`` over another copy gives the same tokens)."""
    tok = tiny_tokenizer()
    model = tiny_model("llama", seed=7, vocab=tok.vocab_size)
    cfg = EngineConfig(attention="exact")
    bcfg = BatchConfig(max_batch=max_batch, max_len=CTX + 1)
    return tok, BatchEngine(model, cfg, bcfg, tok.eos_ids, tok.decode)


@contextlib.contextmanager
def uvicorn_in_thread(app: Any, timeout: float = 30.0) -> Iterator[int]:
    """Serve ``app`` on 127.0.0.1; yields the port; stops the server on exit."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + timeout
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
