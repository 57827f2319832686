"""``specpilot serve``: OpenAI endpoints through the official client on loopback, bad input
(the same OpenAI error bodies from the pydantic request models), request ids, disconnects,
metrics, failures inside the engine thread (logged, a 500 instead of a hang). The server runs a
tiny model and tokenizer in a uvicorn thread."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch

from specpilot.drafters import make_drafter
from specpilot.engine import Engine, GenerationConfig
from specpilot.server import Scheduler, create_app
from specpilot.server.logs import RequestIdFilter, configure_logging, new_request_id, request_id
from specpilot.server.protocol import APIError, parse_request
from specpilot.tokenizer import Tokenizer
from specpilot.tree import TreeSpec

from .conftest import tiny_model
from .server_helpers import CTX, tiny_served, uvicorn_in_thread

MODEL = "tiny-test"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread, and on a busy machine one is far faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@dataclass
class Served:
    base: str
    client: openai.OpenAI
    tok: Tokenizer
    alone: Engine
    spec: TreeSpec
    sched: Scheduler


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    tok, beng = tiny_served(4)
    cfg = beng.cfg
    spec = TreeSpec(kind="chain", k=4)
    sched = Scheduler(beng, lambda: make_drafter("lookup"), spec)
    app = create_app(sched, tok, MODEL, context_len=CTX)
    with uvicorn_in_thread(app) as port:
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        alone_model = tiny_model("llama", seed=7, vocab=tok.vocab_size)  # same weights, own cache
        yield Served(base, client, tok, Engine(alone_model, cfg), spec, sched)


def _alone(s: Served, ids: list[int], n: int) -> str:
    res = s.alone.generate(ids, GenerationConfig(max_new_tokens=n), eos_ids=s.tok.eos_ids)
    return s.tok.decode(res.tokens)


def test_models_and_health(served: Served) -> None:
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    h = httpx.get(served.base + "/health").json()
    assert h["status"] == "ok" and h["max_batch"] == 4


def test_completion_greedy_equals_engine_alone(served: Served) -> None:
    prompt = "the world and the word and the world"
    r = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == _alone(served, served.tok.encode(prompt), 24)
    assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 0
    ids = served.tok.encode(prompt)  # token ids as the prompt; top_p=0 keeps the likeliest only
    r2 = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=24, top_p=0)
    assert r2.choices[0].text == r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")


def test_stop_strings_cut_the_text(served: Served) -> None:
    kw = dict(model=MODEL, prompt="the world and the word", max_tokens=30, temperature=0)
    full = served.client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop and stop in full
    want = full[: full.index(stop)]
    r = served.client.completions.create(**kw, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = served.client.completions.create(**kw, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want


def test_chat_streaming_equals_non_streaming(served: Served) -> None:
    msgs = [{"role": "user", "content": "the world and the word"}]
    full = served.client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=20, temperature=0
    )
    ids = served.tok.encode(served.tok.apply_chat_template(msgs))
    assert full.choices[0].message.content == _alone(served, ids, 20)
    stream = served.client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_concurrent_requests_are_batched_and_lossless(served: Served) -> None:
    prompts = [f"the world {i} and the word {i % 3}" for i in range(8)]

    def one(p: str) -> str:
        r = served.client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
        return r.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, prompts))
    assert texts == [_alone(served, served.tok.encode(p), 16) for p in prompts]
    m = httpx.get(served.base + "/metrics").text
    buckets = {
        ln.split('le="')[1].split('"')[0]: float(ln.split()[-1])
        for ln in m.splitlines()
        if ln.startswith("specpilot_step_batch_size_bucket")
    }
    assert buckets["1.0"] < buckets["+Inf"]  # some steps decoded several sequences
    assert _metric(m, "specpilot_prefill_seconds_count") >= len(prompts)
    assert _metric(m, "specpilot_prefill_seconds_sum") > 0
    step_s = _metric(m, "specpilot_step_seconds_sum")
    verify_s = _metric(m, "specpilot_verify_seconds_total")
    drafted = {  # steps by what drafted, and their drafting seconds
        ln.split('"')[1]: float(ln.split()[-1])
        for ln in m.splitlines()
        if ln.startswith("specpilot_draft_seconds_total{")
    }
    assert drafted and set(drafted) <= {"none", "full", "probe", "none+cheap", "full+cheap",
                                        "probe+cheap"}  # fmt: skip
    assert 0 < verify_s + sum(drafted.values()) <= step_s
    steps = _metric(m, "specpilot_steps_total")
    assert sum(
        float(ln.split()[-1]) for ln in m.splitlines()
        if ln.startswith("specpilot_drafted_steps_total{")
    ) == steps  # fmt: skip
    for name in (
        "specpilot_generation_tokens_total",
        "specpilot_tau",
        'specpilot_acceptance_by_depth{depth="1"}',
        "specpilot_step_seconds_count",
        "specpilot_queue_depth",
    ):
        assert name in m


def test_seeded_sampling_streams_reproducibly(served: Served) -> None:
    def run(seed: int, stream: bool) -> str:
        kw = dict(model=MODEL, prompt="the world", max_tokens=16, temperature=1.0, seed=seed)
        if not stream:
            return served.client.completions.create(**kw).choices[0].text
        return "".join(
            c.choices[0].text for c in served.client.completions.create(**kw, stream=True)
        )

    assert run(3, False) == run(3, True) == run(3, False)
    assert len({run(s, False) for s in range(4)}) > 1


def _metric(text: str, name: str) -> float:
    """The value of the sample ``name`` in a /metrics body."""
    return next(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " "))


def _err(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def test_bad_input_gets_openai_errors(served: Served) -> None:
    url = served.base + "/v1/completions"
    ok = {"model": MODEL, "prompt": "the world", "max_tokens": 4}
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    _err(r, 400)
    _err(httpx.post(url, json=[1, 2]), 400)
    assert _err(httpx.post(url, json={**ok, "model": "gpt-9"}), 404, "model")["code"] == (
        "model_not_found"
    )
    _err(httpx.post(url, json={**ok, "max_tokens": 0}), 400, "max_tokens")
    _err(httpx.post(url, json={**ok, "max_tokens": 10**9}), 400, "max_tokens")
    _err(httpx.post(url, json={**ok, "temperature": 2.5}), 400, "temperature")
    _err(httpx.post(url, json={**ok, "temperature": "hot"}), 400, "temperature")
    _err(httpx.post(url, json={**ok, "top_p": 1.5}), 400, "top_p")
    _err(httpx.post(url, json={**ok, "n": 3}), 400, "n")
    _err(httpx.post(url, json={"model": MODEL}), 400, "prompt")
    long = {**ok, "prompt": "the world " * 300}
    assert _err(httpx.post(url, json=long), 400, "prompt")["code"] == "context_length_exceeded"
    room = {**ok, "prompt": "the world " * 40, "max_tokens": CTX - 5}
    assert _err(httpx.post(url, json=room), 400)["code"] == "context_length_exceeded"
    n = len(served.tok.encode("the world " * 40))  # fits without the 4 draft nodes, not with
    edge = {**ok, "prompt": "the world " * 40, "max_tokens": CTX - n - 3}
    assert _err(httpx.post(url, json=edge), 400)["code"] == "context_length_exceeded"
    chat = served.base + "/v1/chat/completions"
    _err(httpx.post(chat, json={"model": MODEL, "messages": []}), 400, "messages")
    _err(httpx.get(served.base + "/v1/nothing"), 404)
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        served.client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=9)
    # the server still serves
    assert httpx.post(url, json=ok).status_code == 200


def test_client_disconnect_mid_stream_cancels_cleanly(served: Served) -> None:
    url = served.base + "/v1/completions"
    body = {"model": MODEL, "prompt": "the world", "max_tokens": 150, "stream": True}
    body["temperature"] = 0
    with httpx.stream("POST", url, json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[6:])
                break  # leave after the first chunk; closing the stream disconnects
    deadline = time.time() + 20
    while time.time() < deadline:
        m = httpx.get(served.base + "/metrics").text
        if 'specpilot_requests_total{outcome="cancelled"}' in m:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the disconnected request was not cancelled")
    r = served.client.completions.create(model=MODEL, prompt="the word", max_tokens=5)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(served.base + "/health").json()["running"] == 0


# -- request validation: the same OpenAI error bodies ------------------------------------------

P = {"model": MODEL, "prompt": "x"}
C = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
BAD_COMPLETIONS = [
    ([1, 2], None, "the request body must be a JSON object"),
    ({"prompt": "x"}, "model", "'model' is required"),
    ({"model": MODEL}, "prompt", "'prompt' is required"),
    ({**P, "prompt": ""}, "prompt", "'prompt' must not be empty"),
    ({**P, "prompt": [1, True]}, "prompt", "'prompt' must be one string or one list of token ids"),
    ({**P, "max_tokens": 0}, "max_tokens", "'max_tokens' must be between 1 and 199, got 0"),
    ({**P, "max_tokens": 2.0}, "max_tokens", "'max_tokens' must be an integer, got 2.0"),
    ({**P, "temperature": "hot"}, "temperature", "'temperature' must be a number, got 'hot'"),
    ({**P, "temperature": True}, "temperature", "'temperature' must be a number, got True"),
    (
        {**P, "temperature": 2.5},
        "temperature",
        "'temperature' must be between 0.0 and 2.0, got 2.5",
    ),
    ({**P, "top_p": -0.1}, "top_p", "'top_p' must be between 0.0 and 1.0, got -0.1"),
    ({**P, "top_k": -2}, "top_k", f"'top_k' must be between -1 and {1 << 30}, got -2"),
    ({**P, "seed": "7"}, "seed", "'seed' must be an integer, got '7'"),
    ({**P, "n": 2}, "n", "only n=1 is supported"),
    ({**P, "best_of": 3}, "best_of", "only best_of=1 is supported"),
    ({**P, "logprobs": 2}, "logprobs", "'logprobs' is not supported by this server"),
    (
        {**P, "presence_penalty": 0.5},
        "presence_penalty",
        "'presence_penalty' is not supported (sampling stays lossless)",
    ),
    ({**P, "stream": "yes"}, "stream", "'stream' must be a boolean"),
    ({**P, "stream_options": 3}, "stream_options", "'stream_options' must be an object"),
    ({**P, "stop": [""]}, "stop", "'stop' must be a non-empty string or a list of them"),
    ({**P, "stop": list("abcde")}, "stop", "'stop' takes at most 4 strings"),
]
BAD_CHATS = [
    ({"model": MODEL}, "messages", "'messages' must be a non-empty list"),
    (
        {**C, "messages": [{"content": "x"}]},
        "messages",
        "messages[0] must be an object with a 'role'",
    ),
    (
        {**C, "messages": [{"role": "user", "content": 3}]},
        "messages",
        "messages[0].content must be a string",
    ),
    (
        {**C, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        "messages",
        "messages[0]: only text content is supported",
    ),
    (
        {**C, "max_completion_tokens": 0},
        "max_tokens",
        "'max_tokens' must be between 1 and 199, got 0",
    ),
]


def test_malformed_requests_get_the_same_openai_error_bodies(served: Served) -> None:
    for path, cases in (("/v1/completions", BAD_COMPLETIONS), ("/v1/chat/completions", BAD_CHATS)):
        for body, param, message in cases:
            r = httpx.post(served.base + path, json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json() == {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": param,
                    "code": None,
                }
            }, body
            # the same body outside FastAPI: the same error
            with pytest.raises(APIError) as e:
                parse_request(body, path.endswith("chat/completions"), CTX - 1)
            assert (e.value.status, e.value.param, e.value.message) == (400, param, message)
    r = httpx.post(served.base + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "the request body is not valid JSON",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_json",
    }


def test_valid_bodies_parse_as_before() -> None:
    text = [{"type": "text", "text": "hi"}]
    chat = parse_request(
        {**C, "messages": [{"role": "user", "content": text}], "max_completion_tokens": 5,
         "max_tokens": 9, "top_p": 0, "stop": "x", "echo": True, "stream": True,
         "stream_options": {"include_usage": True}, "user": "ignored"},
        chat=True, context_len=CTX,
    )  # fmt: skip
    assert chat.messages == ({"role": "user", "content": "hi"},) and chat.max_tokens == 5
    assert (chat.top_p, chat.top_k, chat.stop, chat.echo) == (1.0, 1, ("x",), False)
    assert chat.stream and chat.include_usage and chat.temperature == 1.0 and chat.seed is None
    comp = parse_request(
        {**P, "prompt": [[5, 6]], "temperature": 0, "top_k": -1, "seed": 3, "echo": True},
        chat=False, context_len=CTX,
    )  # fmt: skip
    assert comp.prompt == [5, 6] and comp.max_tokens == 16 and comp.temperature == 0.0
    assert (comp.top_k, comp.seed, comp.echo, comp.stop, comp.chat) == (0, 3, True, (), False)
    no_content = parse_request({**C, "messages": [{"role": "user"}]}, True, CTX)
    assert no_content.max_tokens is None and no_content.messages == (
        {"role": "user", "content": ""},
    )


# -- request ids and logging ---------------------------------------------------------------------


def test_every_response_carries_a_request_id(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specpilot.server")
    ok = {"model": MODEL, "prompt": "the world", "max_tokens": 3}
    r = httpx.post(served.base + "/v1/completions", json=ok)
    rid = r.headers["x-request-id"]
    assert r.status_code == 200 and len(rid) == 32
    again = httpx.post(served.base + "/v1/completions", json=ok).headers["x-request-id"]
    assert again != rid  # one id per request
    mine = httpx.get(served.base + "/health", headers={"x-request-id": "client-id.7"})
    assert mine.headers["x-request-id"] == "client-id.7"  # the client's own id comes back
    odd = httpx.get(served.base + "/health", headers={"x-request-id": "a b<script>"})
    assert odd.headers["x-request-id"] != "a b<script>" and len(odd.headers["x-request-id"]) == 32
    bad = httpx.post(served.base + "/v1/completions", json={**ok, "n": 2})
    assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 32
    missing = httpx.get(served.base + "/v1/nothing")
    assert missing.status_code == 404 and missing.headers["x-request-id"]
    stream = httpx.post(served.base + "/v1/completions", json={**ok, "stream": True})
    assert stream.status_code == 200 and len(stream.headers["x-request-id"]) == 32
    lines = [r.getMessage() for r in caplog.records if r.name == "specpilot.server"]
    assert any(line.startswith("POST /v1/completions 200 ") for line in lines), lines
    assert any(line.startswith("GET /health 200 ") for line in lines)
    assert any(line.startswith("POST /v1/completions 400 ") for line in lines)


def test_request_id_filter_and_ids() -> None:
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    token = request_id.set("abc")
    try:
        assert RequestIdFilter().filter(rec) and rec.request_id == "abc"  # type: ignore[attr-defined]
    finally:
        request_id.reset(token)
    rec2 = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    RequestIdFilter().filter(rec2)
    assert rec2.request_id == "-"  # type: ignore[attr-defined]
    assert new_request_id("ok-1") == "ok-1" and new_request_id("x" * 129) != "x" * 129


def test_configure_logging_puts_the_request_id_in_each_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("debug")
        configure_logging("warning")  # again: one handler of ours, the new level
        ours = [h for h in root.handlers if getattr(h, "_specpilot", False)]
        assert len(ours) == 1 and root.level == logging.WARNING
        token = request_id.set("rid-42")
        try:
            logging.getLogger("specpilot.server.test").warning("hello")
        finally:
            request_id.reset(token)
        logging.getLogger("specpilot.server.test").info("not shown at warning")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    assert "WARNING specpilot.server.test [rid-42] hello" in err and "not shown" not in err


# -- failures inside the engine thread -------------------------------------------------------------


def _failing(served: Served, caplog: pytest.LogCaptureFixture, where: str) -> None:
    """A request while ``where`` raises: a 500 OpenAI body, the traceback logged with the
    request id, and the server still serving afterwards."""
    r = httpx.post(
        served.base + "/v1/completions",
        json={"model": MODEL, "prompt": "the world", "max_tokens": 8, "temperature": 0},
        timeout=30,
    )
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "planted failure" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    rid = r.headers["x-request-id"]
    logged = [x for x in caplog.records if x.name == "specpilot.server.scheduler"]
    assert logged and all(x.levelno == logging.ERROR for x in logged), where
    assert any(x.exc_info and "planted failure" in str(x.exc_info[1]) for x in logged)
    assert any(rid in x.getMessage() for x in logged), [x.getMessage() for x in logged]


def test_a_failing_step_is_logged_and_fails_the_request_with_500(
    served: Served, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("planted failure")

    monkeypatch.setattr(served.sched.engine, "step", boom)
    _failing(served, caplog, "step")
    monkeypatch.undo()
    r = served.client.completions.create(model=MODEL, prompt="the word", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_failure_outside_any_request_is_logged_not_a_hang(
    served: Served, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Metrics raising after a step used to end the engine thread, leaving requests waiting
    forever; now the loop logs it, fails the requests it holds and keeps serving."""

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("planted failure")

    monkeypatch.setattr(served.sched.metrics, "observe_step", boom)
    _failing(served, caplog, "loop")
    assert any("engine loop failed" in x.getMessage() for x in caplog.records)
    monkeypatch.undo()
    assert served.sched.alive and httpx.get(served.base + "/health").json()["running"] == 0
    r = served.client.completions.create(model=MODEL, prompt="the word", max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_dead_engine_thread_answers_500_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    tok, beng = tiny_served(2)
    sched = Scheduler(beng)
    monkeypatch.setattr(sched, "_loop", lambda: None)  # the worker thread ends at once
    with uvicorn_in_thread(create_app(sched, tok, MODEL, context_len=CTX)) as port:
        base = f"http://127.0.0.1:{port}"
        body = {"model": MODEL, "prompt": "the world", "max_tokens": 4}
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "engine thread" in r.json()["error"]["message"]
        s = httpx.post(base + "/v1/completions", json={**body, "stream": True}, timeout=30)
        assert s.status_code == 200 and '"server_error"' in s.text
        assert httpx.get(base + "/health").status_code == 503
