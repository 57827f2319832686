"""Seeded sampling is a function of the seed and the prompt only: the same text alone, inside a
batch of 8 (whose node budget cuts the draft trees), twice in one batch, with or without
speculation, and through ``serve`` with 8 concurrent requests."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from specpilot import sampling
from specpilot.batch import BatchConfig, BatchEngine, BatchRequest, VerifyBudget, run_batch
from specpilot.drafters import make_drafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.sampling import SamplingParams, target_probs, verify_tree_matching
from specpilot.server import Scheduler, create_app
from specpilot.tree import DraftTree, TreeSpec

from .conftest import tiny_model
from .server_helpers import uvicorn_in_thread
from .test_sampling import P_MIN, V, _logits, chi2_pvalue
from .test_tokenizer import tiny_tokenizer

CFG = EngineConfig(attention="exact", linear="onednn")
PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4], [10, 20, 30, 10, 20, 30], [7, 7, 7, 7], [1, 2, 1, 2, 1]]
SPEC = TreeSpec(kind="chain", k=4)
BUDGET = VerifyBudget(((1, 8), (2, 1)))
"""8 draft nodes alone, 1 per sequence in a batch: batching cuts the trees."""


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_matching_verification_draws_from_the_target() -> None:
    params = SamplingParams(0.8, top_k=5)
    logits = _logits(3, rows=6)
    p0, p1 = target_probs(logits[0], params), target_probs(logits[1], params)
    a = int(p0.argmax())
    tree = DraftTree.from_parents([a, 0, 4, 1, 3], [-1, -1, -1, 0, 0])
    gen = torch.Generator().manual_seed(1)
    first, second = torch.zeros(V), torch.zeros(V)
    accepted = 0
    for _ in range(4000):
        acc = verify_tree_matching(tree, logits, params, gen)
        first[acc.tokens[0]] += 1
        accepted += len(acc.path)
        if acc.tokens[0] == a:
            second[acc.tokens[1]] += 1
    assert chi2_pvalue(first, p0) > P_MIN and chi2_pvalue(second, p1) > P_MIN
    kids = sorted({a, 0, 4})
    expect = float(p0[kids].sum())  # a point-mass draft x is accepted with p(x)
    assert abs(accepted_first(first, kids) - expect) < 0.03 and accepted > 0


def accepted_first(first: torch.Tensor, kids: list[int]) -> float:
    return float(first[kids].sum() / first.sum())


def _gen(seed: int, n: int = 40) -> GenerationConfig:
    """Temperature 0.5: the tiny model's drafts get accepted often enough to be cut."""
    return GenerationConfig(max_new_tokens=n, stop_on_eos=False, temperature=0.5, seed=seed)


def test_engine_seeded_speculation_equals_seeded_ar() -> None:
    model = tiny_model("qwen3", seed=4)
    eng = Engine(model, CFG)
    for seed, prompt in enumerate(PROMPTS):
        ar = eng.generate(prompt, _gen(seed)).tokens
        for spec in (SPEC, TreeSpec(kind="dynamic", budget=6, topk=2, depth=3)):
            res = eng.generate(prompt, _gen(seed), drafter=make_drafter("lookup"), spec=spec)
            assert res.tokens == ar


def _requests(items: list[tuple[list[int], int]]) -> list[BatchRequest]:
    return [BatchRequest(p, _gen(s), make_drafter("lookup"), SPEC) for p, s in items]


def test_seeded_request_alone_equals_inside_a_batch_of_8() -> None:
    model = tiny_model("qwen3", seed=4)
    beng = BatchEngine(model, CFG, BatchConfig(max_batch=8, max_len=96, budget=BUDGET))
    items = [(PROMPTS[0], 11), (PROMPTS[0], 11)]  # two identical seeded requests
    items += [(PROMPTS[i % 4], 20 + i) for i in range(1, 7)]
    alone = [run_batch(beng, _requests([it]))[0].result for it in items]
    steps: list[int] = []
    batch = run_batch(beng, _requests(items), on_step=lambda st: steps.append(len(st.accepted)))
    assert max(steps) == 8  # really decoded as a batch of 8
    assert [o.result.tokens for o in batch] == [r.tokens for r in alone]
    assert batch[0].result.tokens == batch[1].result.tokens
    assert max(max(r.draft_nodes) for r in alone) > 1  # alone: trees beyond the batch's cut
    assert [r.draft_nodes for r in alone] != [o.result.draft_nodes for o in batch]
    assert any(sum(o.result.accept_lengths) for o in batch)  # speculation accepted tokens
    assert len({tuple(r.tokens) for r in alone}) > 2  # the seeds matter


def test_the_batch_test_has_power(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the rejection test on point-mass drafts (draws depend on the trees), batching
    changes seeded outputs: the test above would see it."""
    monkeypatch.setattr(
        sampling.Sampler,
        "verify",
        lambda self, tree, logits: sampling.verify_tree_sampling(
            tree, logits.cpu(), self.params, self.gen
        ),
    )
    model = tiny_model("qwen3", seed=4)
    beng = BatchEngine(model, CFG, BatchConfig(max_batch=8, max_len=96, budget=BUDGET))
    items = [(PROMPTS[i % 4], 20 + i) for i in range(8)]
    alone = [run_batch(beng, _requests([it]))[0].result.tokens for it in items]
    batch = [o.result.tokens for o in run_batch(beng, _requests(items))]
    assert batch != alone


def test_serve_8_concurrent_seeded_requests_equal_8_solo() -> None:
    tok = tiny_tokenizer()
    model = tiny_model("llama", seed=7, vocab=tok.vocab_size)
    bcfg = BatchConfig(max_batch=8, max_len=161, budget=BUDGET)
    beng = BatchEngine(model, CFG, bcfg, tok.eos_ids, tok.decode)
    app = create_app(Scheduler(beng, lambda: make_drafter("lookup"), SPEC), tok, "t", 160)
    prompts = ["the world and the word", "hello hello world", "a b a b a b", "the the the"]
    with uvicorn_in_thread(app) as port:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120
        )

        seeds = [100, 101, 102, 103, 100, 101, 200, 201]  # 4 and 5 repeat 0 and 1

        def run(i: int) -> str:
            r = client.completions.create(
                model="t", prompt=prompts[i % 4], max_tokens=32, temperature=0.5, seed=seeds[i]
            )
            return r.choices[0].text

        solo = [run(i) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(run, range(8)))
    assert together == solo
    assert together[0] == together[4] and together[1] == together[5]  # identical, one batch
    assert len(set(solo)) > 2
