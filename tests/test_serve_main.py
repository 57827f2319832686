"""``specpilot serve``'s process layout (:func:`specpilot.server.serve_in_main`): the engine steps
in the main thread, HTTP runs in a thread of its own, SIGTERM shuts down after the requests in
flight, a port already taken is a clear error; and a step's events reach their event loop with
one wake-up."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn

from specpilot.batch import BatchEngine
from specpilot.drafters import make_drafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.errors import ConfigError, SpecPilotError
from specpilot.server import Scheduler, create_app, serve_in_main
from specpilot.server.scheduler import Event, Job
from specpilot.tree import TreeSpec

from .conftest import tiny_model
from .server_helpers import CTX, tiny_served


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parts() -> tuple[Any, BatchEngine, Scheduler]:
    tok, beng = tiny_served(4)
    spec = TreeSpec(kind="chain", k=4)
    return tok, beng, Scheduler(beng, lambda: make_drafter("lookup"), spec, own_thread=False)


def test_engine_steps_in_the_main_thread_and_sigterm_drains() -> None:
    assert threading.current_thread() is threading.main_thread()  # signals need it
    before = signal.getsignal(signal.SIGTERM)
    tok, beng, sched = _parts()
    stepped: list[threading.Thread] = []
    step = beng.step

    def recorded():  # type: ignore[no-untyped-def]
        stepped.append(threading.current_thread())
        return step()

    beng.step = recorded  # type: ignore[method-assign]
    port = _free_port()
    config = uvicorn.Config(create_app(sched, tok, "t", CTX), host="127.0.0.1", port=port,
                            log_level="warning")  # fmt: skip
    server = uvicorn.Server(config)
    got: dict[str, Any] = {}
    prompt = "the world and the word"

    def client() -> None:
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.02)
            body = {"model": "t", "prompt": prompt, "max_tokens": 12, "temperature": 0}
            got["text"] = httpx.post(base + "/v1/completions", json=body, timeout=30).json()[
                "choices"][0]["text"]  # fmt: skip
            with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                              timeout=30) as r:  # fmt: skip
                os.kill(os.getpid(), signal.SIGTERM)  # mid-request: it must still finish
                got["stream"] = "".join(r.iter_lines())
        finally:
            server.should_exit = True  # never leave the test hanging

    threading.Thread(target=client, daemon=True).start()
    serve_in_main(sched, server)
    same = tiny_model("llama", seed=7, vocab=tok.vocab_size)  # the served weights, own cache
    alone = Engine(same, EngineConfig(attention="exact"))
    gen = GenerationConfig(max_new_tokens=12)
    res = alone.generate(tok.encode(prompt), gen, eos_ids=tok.eos_ids)
    assert got["text"] == tok.decode(res.tokens)
    assert "[DONE]" in got["stream"]  # the request in flight when SIGTERM came finished
    assert stepped and all(t is threading.main_thread() for t in stepped)
    assert not sched.alive
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are restored


def test_a_taken_port_is_a_config_error() -> None:
    tok, _, sched = _parts()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = uvicorn.Config(create_app(sched, tok, "t", CTX), host="127.0.0.1", port=port,
                                log_level="critical")  # fmt: skip
        with pytest.raises(ConfigError, match=f"could not start on 127.0.0.1:{port}"):
            serve_in_main(sched, uvicorn.Server(config))
    assert not sched.alive


def test_a_scheduler_with_its_own_thread_cannot_be_run_here() -> None:
    _, beng, _ = _parts()
    with pytest.raises(RuntimeError, match="own thread"):
        Scheduler(beng, None, own_thread=True).run()


def test_a_steps_events_wake_the_event_loop_once() -> None:
    class Loop:  # records the wake-ups; runs the callbacks when asked
        def __init__(self) -> None:
            self.calls: list[tuple[Any, tuple]] = []

        def call_soon_threadsafe(self, fn: Any, *args: Any) -> None:
            self.calls.append((fn, args))

    _, _, sched = _parts()
    loop = Loop()
    gen = GenerationConfig(max_new_tokens=4)
    jobs = [Job([1, 2], gen, loop) for _ in range(3)]  # type: ignore[arg-type]
    for i, job in enumerate(jobs):
        sched._send(job, Event("tokens", (i,)))
    sched._send(jobs[0], Event("done"))
    assert not loop.calls  # nothing until the flush
    sched._flush()
    assert len(loop.calls) == 1
    fn, args = loop.calls[0]
    fn(*args)
    got = [[job.events.get_nowait() for _ in range(job.events.qsize())] for job in jobs]
    assert [[e.kind for e in evs] for evs in got] == [["tokens", "done"], ["tokens"], ["tokens"]]
    assert [evs[0].tokens for evs in got] == [(0,), (1,), (2,)]
    sched._flush()
    assert len(loop.calls) == 1  # an empty outbox wakes nobody


def test_an_http_thread_that_stops_on_its_own_is_an_error() -> None:
    class Crashing:  # starts, then its thread ends without a signal or a lifespan shutdown
        should_exit = force_exit = started = False

        def run(self) -> None:
            self.started = True
            raise RuntimeError("the event loop broke")

    _, _, sched = _parts()
    with pytest.raises(SpecPilotError, match="stopped on its own"):
        serve_in_main(sched, Crashing())
    assert not sched.alive
