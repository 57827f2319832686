"""The agents against endpoints that misbehave (scripted, loopback), and against ``specpilot serve``
with a tiny model through the real ``openai`` client: every failure becomes a recorded reason,
retries back off and stop, several agents take different directions, and nothing raises."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specpilot.agent import client as cl
from specpilot.agent.explorer import AgentExplorer
from specpilot.agent.store import write_source
from specpilot.mechanisms import all_mechanisms
from specpilot.mechanisms.base import Context
from specpilot.pilot.config import OptimizeConfig
from specpilot.pilot.explorer import RoundAsk
from specpilot.pilot.memory import Memory
from specpilot.pilot.records import Item
from specpilot.pilot.sandbox import SandboxSpec
from specpilot.plan import Plan

from . import agent_sources as src
from .agent_endpoint import Delay, Raw, Status, serve
from .agent_helpers import KEY, agent_config
from .server_helpers import uvicorn_in_thread

PLAN = Plan().to_json()  # suffix drafter, chain k=5
CTX = Context("llama", 1.0, "suffix", "cpu", "float32", threads=2)
FACTORS = {"tau": 1.4, "kernel": 1.2, "overhead": 1.1}


def _client(url: str, sleeps: list[float], **kw: Any) -> cl.ChatClient:
    return cl.ChatClient(agent_config(url, **kw), KEY, sleep=sleeps.append)


MSG = [{"role": "user", "content": "hi"}]


def test_rate_limits_and_server_errors_are_retried_with_backoff() -> None:
    sleeps: list[float] = []
    with serve([Status(429, retry_after=0.02), Status(503), Status(429), "done"]) as ep:
        text, attempts = _client(ep.url, sleeps, retries=3, backoff_s=0.01).complete(MSG)
    assert (text, attempts) == ("done", 4)
    assert sleeps == [0.02, 0.02, 0.04]  # Retry-After honoured, then doubling, capped at 0.05


def test_failures_that_end_a_request(tmp_path: Path) -> None:
    sleeps: list[float] = []
    with serve([Status(429)] * 5) as ep, pytest.raises(cl.AgentError) as e:
        _client(ep.url, sleeps, retries=2).complete(MSG)
    assert (e.value.kind, e.value.attempts, len(sleeps)) == (cl.RATE_LIMITED, 3, 2)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there: the endpoint is down
    with pytest.raises(cl.AgentError) as e:
        _client(f"http://127.0.0.1:{port}/v1", sleeps, retries=1).complete(MSG)
    assert e.value.kind == cl.UNREACHABLE and e.value.attempts == 2
    cases = [
        ([Status(401)], cl.HTTP_ERROR, "HTTP 401", 1),  # not retried
        ([Raw(b"<html>not json</html>")], cl.MALFORMED, "malformed", 1),
        ([None], cl.EMPTY, "empty reply", 1),
        ([Raw(json.dumps({"choices": []}).encode())], cl.MALFORMED, "malformed", 1),
        ([Delay(3.0), Delay(3.0)], cl.TIMEOUT, "no reply within", 2),
    ]
    for script, kind, why, attempts in cases:
        with serve(script) as ep, pytest.raises(cl.AgentError) as e:
            _client(ep.url, [], retries=1, timeout_s=0.5).complete(MSG)
        assert (e.value.kind, e.value.attempts) == (kind, attempts), e.value.reason
        assert why in e.value.reason


def test_the_key_is_masked_in_reasons() -> None:
    body = json.dumps({"error": {"message": f"Incorrect API key provided: {KEY}"}}).encode()
    with serve([Raw(body, code=401)]) as ep, pytest.raises(cl.AgentError) as e:
        _client(ep.url, []).complete(MSG)
    assert KEY not in e.value.reason and "***" in e.value.reason


def _propose(ex: AgentExplorer, order: tuple[str, ...]) -> tuple[list[Item], list[Any]]:
    got = ex.propose(RoundAsk(0, PLAN, FACTORS, {}, order, 1, 4))
    return got.items, got.log or []


@pytest.fixture
def explorer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def make(url: str, **kw: Any) -> AgentExplorer:
        monkeypatch.setenv("SPECPILOT_TEST_AGENT_KEY", KEY)
        workers = kw.pop("workers", 1)
        acfg = agent_config(url, **{"retries": 1, **kw})
        cfg = OptimizeConfig(out=str(tmp_path / "run"), memory=str(tmp_path / "m.sqlite"),
                             agent=acfg.to_json(), workers=workers)  # fmt: skip
        mem = Memory(cfg.memory)
        mechs = {m.id: m for m in all_mechanisms()}
        log: list[dict[str, Any]] = []
        ex = AgentExplorer(cfg, Path(cfg.out), "run0", mem, mechs, lambda p: CTX, log.append)
        made.append(mem)
        return ex

    made: list[Memory] = []
    yield make
    for m in made:
        m.close()


def test_parameter_proposals_are_checked_against_the_space(explorer: Any) -> None:
    replies = [
        '```json\n{"mechanism": "warp_drive", "params": {}}\n```',
        '```json\n{"mechanism": "chain_length", "params": {"k": 99}}\n```',
        '```json\n{"mechanism": "chain_length", "params": {"k": 5}}\n```',  # the current k
        '```json\n{"mechanism": "chain_length", "params": {"k": 7}}\n```',
    ]
    with serve(replies) as ep:
        ex = explorer(ep.url, requests_per_round=4)
        items, log = _propose(ex, ("tau", "kernel", "overhead"))
    assert [(e["stage"], e["status"]) for e in log] == [("params", "rejected")] * 3 + [
        ("accepted", "accepted")
    ]
    assert "unknown mechanism 'warp_drive'" in log[0]["reason"]
    assert "outside" in log[1]["reason"] and "does not change the plan" in log[2]["reason"]
    assert items == [Item("chain_length", {"k": 7}, "agent", "tau", agent=0)]
    last = ep.requests[-1]["body"]["messages"][1]["content"]
    assert "unknown mechanism 'warp_drive'" in last  # its failures are shown to it


def test_two_agents_explore_two_directions_at_once(explorer: Any) -> None:
    started: list[float] = []
    lock = threading.Lock()
    with serve([Delay(0.5), Delay(0.5)], default="no idea") as ep:
        ex = explorer(ep.url, workers=2, requests_per_round=1)
        real = ex.client.complete

        def timed(msgs: Any) -> Any:
            with lock:
                started.append(time.monotonic())
            return real(msgs)

        ex.client.complete = timed
        items, log = _propose(ex, ("tau", "kernel", "overhead"))
    assert items == [] and {e["direction"] for e in log} == {"tau", "kernel"}
    assert [e["agent"] for e in sorted(log, key=lambda e: e["agent"])] == [0, 1]
    assert max(started) - min(started) < 0.4  # both requests were in flight together
    dirs = {r["body"]["messages"][1]["content"].split("**")[1] for r in ep.requests}
    assert dirs == {"tau", "kernel"}


def test_endpoint_down_leaves_the_round_to_the_builtin_explorer(explorer: Any) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    ex = explorer(f"http://127.0.0.1:{port}/v1", requests_per_round=3)
    items, log = _propose(ex, ("tau",))
    assert items == []
    (entry,) = log  # one request, retried, then the agent sits the round out
    assert (entry["stage"], entry["status"], entry["attempts"]) == ("endpoint", "unreachable", 2)


# -- specpilot serve as the endpoint -----------------------------------------------------------


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    import torch

    from specpilot.batch import BatchConfig, BatchEngine
    from specpilot.drafters import make_drafter
    from specpilot.engine import EngineConfig
    from specpilot.server import Scheduler, create_app
    from specpilot.tree import TreeSpec

    from .conftest import tiny_model
    from .test_tokenizer import tiny_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = tiny_tokenizer()
    model = tiny_model("llama", seed=7, vocab=tok.vocab_size, max_position=1024)
    bcfg = BatchConfig(max_batch=2, max_len=1001)
    beng = BatchEngine(model, EngineConfig(attention="exact"), bcfg, tok.eos_ids, tok.decode)
    sched = Scheduler(beng, lambda: make_drafter("lookup"), TreeSpec(kind="chain", k=4))
    app = create_app(sched, tok, "tiny-agent", context_len=1000)
    with uvicorn_in_thread(app) as port:
        yield f"http://127.0.0.1:{port}/v1"
    torch.set_num_threads(threads)


def test_serve_replies_go_through_the_openai_client_and_are_rejected(
    served: str, explorer: Any
) -> None:
    ex = explorer(served, model="tiny-agent", max_tokens=24, max_prompt_chars=300,
                  requests_per_round=2, temperature=0.0)  # fmt: skip
    items, log = _propose(ex, ("tau",))
    assert items == [] and len(log) == 2
    for e in log:  # a real completion came back; it holds no proposal
        assert e["attempts"] == 1 and (e["stage"], e["status"]) in (
            ("parse", "rejected"), ("endpoint", "empty"),
        ), e  # fmt: skip
    assert any(e["stage"] == "parse" for e in log)


def test_a_resumed_run_re_registers_its_journaled_modules(tmp_path: Path) -> None:
    cfg = OptimizeConfig(out=str(tmp_path / "run"), memory=str(tmp_path / "m.sqlite"))
    mem = Memory(cfg.memory)
    mechs = {m.id: m for m in all_mechanisms()}
    args = (cfg, Path(cfg.out), "run0", mem, mechs, lambda p: CTX, [].append)
    assert AgentExplorer.start(*args, [], PLAN) is None  # nothing agent-written: no sandbox
    mod = write_source(Path(cfg.out) / "agent", src.GOOD)
    mod.mechanisms = [{"id": "agent_unslow", "factor": "kernel", "description": "d",
                       "space": [], "applicable": None, "wraps_decode": False}]  # fmt: skip
    rec = {"type": "candidates", "agent": [{"stage": "accepted", "module": mod.to_json()}]}
    ex = AgentExplorer.start(*args, [rec], PLAN)
    assert ex is not None and mechs["agent_unslow"].factor == "kernel"
    mods, path, box = ex.child_extras(PLAN, [("agent_unslow", {})])
    assert mods == (mod.module,) and path == (mod.directory,)
    assert SandboxSpec.from_arg(box).layers == ex.layers and "audit" in ex.layers
    assert ex.child_extras(PLAN, [("chain_length", {"k": 3})])[:2] == ((), ())
    del mechs["agent_unslow"]
    (Path(mod.directory) / f"{mod.module}.py").write_text(src.GOOD + "\n# edited\n")
    AgentExplorer.start(*args, [rec], PLAN)  # a source changed on disk is not trusted again
    assert "agent_unslow" not in mechs
    mem.close()
