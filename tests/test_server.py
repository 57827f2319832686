"""``specpilot serve``: OpenAI endpoints through the official client on loopback, bad input,
disconnects, metrics. The server runs a tiny model and tokenizer in a uvicorn thread."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch

from specpilot.batch import BatchConfig, BatchEngine
from specpilot.drafters import make_drafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.server import Scheduler, create_app
from specpilot.tokenizer import Tokenizer
from specpilot.tree import TreeSpec

from .conftest import tiny_model
from .server_helpers import uvicorn_in_thread
from .test_tokenizer import tiny_tokenizer

MODEL = "tiny-test"
CTX = 200


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


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    tok = tiny_tokenizer()
    model = tiny_model("llama", seed=7, vocab=tok.vocab_size)
    cfg = EngineConfig(attention="exact")
    spec = TreeSpec(kind="chain", k=4)
    beng = BatchEngine(
        model, cfg, BatchConfig(max_batch=4, max_len=CTX + 1), tok.eos_ids, tok.decode
    )
    sched = Scheduler(beng, lambda: make_drafter("lookup"), spec)
    app = create_app(sched, tok, MODEL, context_len=CTX)
    with uvicorn_in_thread(app) as port:
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        alone_model = tiny_model("llama", seed=7, vocab=tok.vocab_size)  # same weights, own cache
        yield Served(base, client, tok, Engine(alone_model, cfg), spec)


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
