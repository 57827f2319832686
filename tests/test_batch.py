"""Batched decoding: every sequence's output equals the sequence decoded alone, bit for bit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from specpilot.batch import (
    BatchConfig,
    BatchEngine,
    BatchRequest,
    VerifyBudget,
    allocate_nodes,
    run_batch,
)
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.errors import ConfigError, ContextLengthError
from specpilot.tree import DraftTree, TreeSpec

from .conftest import tiny_model
from .test_engine import SPECS, OracleDrafter

PROMPTS = [[3, 4, 5], [10, 20, 30, 40, 50, 60, 1], [7], [9, 9, 9, 9], [1, 2], [33, 8, 41, 2, 2]]
HITS = [0.0, 0.5, 1.0, 0.8, 0.3, 0.9]
CFG = EngineConfig(attention="exact", linear="onednn")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread, and on a busy machine one is far faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def setup() -> tuple[Engine, BatchEngine, list[list[int]]]:
    model = tiny_model("qwen3", seed=4)
    eng = Engine(model, CFG)
    gen = GenerationConfig(max_new_tokens=32, stop_on_eos=False)
    refs = [eng.generate(p, gen).tokens for p in PROMPTS]
    return eng, BatchEngine(model, CFG, BatchConfig(max_batch=4, max_len=128)), refs


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_batched_speculative_equals_alone(setup, spec: TreeSpec) -> None:
    _, beng, refs = setup
    gen = GenerationConfig(max_new_tokens=32, stop_on_eos=False)
    steps: list[tuple[int, ...]] = []
    reqs = [
        BatchRequest(p, gen, OracleDrafter(r, 64, h, i), spec)
        for i, (p, r, h) in enumerate(zip(PROMPTS, refs, HITS, strict=True))
    ]
    outs = run_batch(beng, reqs, on_step=lambda st: steps.append(st.accepted))
    for o, ref in zip(outs, refs, strict=True):
        assert o.result.tokens == ref
        assert o.latency_s >= o.wait_s
    assert any(len(set(a)) > 1 for a in steps)  # ragged acceptance within a step
    assert max(len(a) for a in steps) == 4  # the batch was full
    assert any(o.wait_s > 0 and o.result.tau > 1 for o in outs)  # admitted as rows freed


def test_batched_ar_and_stop_rules_equal_alone(setup) -> None:
    eng, beng, refs = setup
    eos = refs[0][5]
    gen = GenerationConfig(max_new_tokens=20)
    alone = [eng.generate(p, gen, eos_ids=(eos,)) for p in PROMPTS]
    beng.eos_ids = (eos,)
    try:
        outs = run_batch(beng, [BatchRequest(p, gen) for p in PROMPTS])
        spec_outs = run_batch(
            beng,
            [
                BatchRequest(p, gen, OracleDrafter(r, 64, 1.0, 0), SPECS[0])
                for p, r in zip(PROMPTS, refs, strict=True)
            ],
        )
    finally:
        beng.eos_ids = ()
    for a, o, s in zip(alone, outs, spec_outs, strict=True):
        assert o.result.tokens == a.tokens == s.result.tokens
        assert o.result.stop_reason == a.stop_reason == s.result.stop_reason
        assert o.result.tau == 1.0
    assert any(a.stop_reason == "eos" for a in alone)


def test_batched_sampling_equals_alone_with_same_seed(setup) -> None:
    """With a budget that trims nothing, each sequence consumes its generator as alone."""
    eng, _, refs = setup
    beng = BatchEngine(
        eng.model, CFG, BatchConfig(max_batch=3, max_len=128, budget=VerifyBudget(((1, 64),)))
    )
    spec = SPECS[1]
    gens = [
        GenerationConfig(max_new_tokens=16, stop_on_eos=False, temperature=0.8, top_k=20, seed=i)
        for i in range(len(PROMPTS))
    ]
    alone = [
        eng.generate(p, g, drafter=OracleDrafter(r, 64, 0.7, i), spec=spec).tokens
        for i, (p, r, g) in enumerate(zip(PROMPTS, refs, gens, strict=True))
    ]
    reqs = [
        BatchRequest(p, g, OracleDrafter(r, 64, 0.7, i), spec)
        for i, (p, r, g) in enumerate(zip(PROMPTS, refs, gens, strict=True))
    ]
    assert [o.result.tokens for o in run_batch(beng, reqs)] == alone


def test_allocate_nodes_by_expected_gain() -> None:
    a = DraftTree.from_parents([1, 2, 3, 4], [-1, -1, 0, 2], [-0.1, -1.0, -0.2, -3.0])
    b = DraftTree.chain([7, 8, 9], [-0.3, -0.5, -0.6])
    c = DraftTree.empty()
    ka, kb, kc = allocate_nodes([a, b, c], 5)
    assert ka.tokens.tolist() == [1, 3] and ka.parents.tolist() == [-1, 0]
    assert kb.tokens.tolist() == [7, 8, 9] and kc.size == 0
    assert [t.size for t in allocate_nodes([a, b], 0)] == [0, 0]
    assert [t.size for t in allocate_nodes([a, b], 100)] == [4, 3]
    # min_gain: exp(-0.3) = 0.74 and exp(-0.5) = 0.61 pass 0.6, exp(-0.6) = 0.55 does not
    ka, kb = allocate_nodes([a, b], 100, min_gain=0.6)
    assert ka.tokens.tolist() == [1, 3] and kb.tokens.tolist() == [7, 8]
    # a child scored above its parent is only kept with the parent
    odd = DraftTree.from_parents([1, 2], [-1, 0], [-2.0, -0.1])
    (k,) = allocate_nodes([odd], 1)
    assert k.tokens.tolist() == [1]


def test_verify_budget_table() -> None:
    b = VerifyBudget(((1, 10), (4, 3), (8, 1)))
    assert [b.per_sequence(n) for n in (1, 2, 4, 7, 8, 64)] == [10, 10, 3, 3, 1, 1]
    assert b.total(6) == 18
    assert VerifyBudget.from_table({4: 2}, 8) == VerifyBudget(((1, 8), (4, 2)))
    for bad in (((2, 4),), ((1, 4), (1, 2)), ((1, -1),), ()):
        with pytest.raises(ConfigError):
            VerifyBudget(bad)
    with pytest.raises(ConfigError):
        BatchConfig(max_batch=0)
    with pytest.raises(ConfigError):
        BatchConfig(min_gain=1.5)


def test_batch_rejects_what_cannot_fit(setup) -> None:
    _, beng, _ = setup
    with pytest.raises(ContextLengthError):
        beng.check(BatchRequest(list(range(100)), GenerationConfig(max_new_tokens=40)))
    with pytest.raises(ConfigError):
        beng.check(BatchRequest([], GenerationConfig()))


@pytest.mark.slow
def test_smollm2_batched_speculative_equals_alone() -> None:
    """The real model: batched suffix/chain and batched AR equal each prompt decoded alone."""
    from specpilot.drafters import make_drafter
    from specpilot.loading import load_model
    from specpilot.workloads import load_workload

    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    prompts = [tok.encode_prompt(p.text, chat=p.chat) for p in load_workload("humaneval", limit=5)]
    eng = Engine(loaded.model, EngineConfig())
    gen = GenerationConfig(max_new_tokens=32)
    alone = [eng.generate(p, gen, eos_ids=tok.eos_ids).tokens for p in prompts]
    longest = max(len(p) for p in prompts)
    beng = BatchEngine(loaded.model, EngineConfig(), BatchConfig(3, longest + 48), tok.eos_ids)
    spec = TreeSpec(kind="chain", k=5)
    outs = run_batch(beng, [BatchRequest(p, gen, make_drafter("suffix"), spec) for p in prompts])
    assert [o.result.tokens for o in outs] == alone
    assert any(o.result.tau > 1 for o in outs)
    ar = run_batch(beng, [BatchRequest(p, gen) for p in prompts])
    assert [o.result.tokens for o in ar] == alone


def test_run_batch_tells_the_engine_how_many_requests_wait(setup) -> None:
    """The goodput budget prices draft tokens by whether a freed row is refilled: run_batch
    sets ``waiting`` before every step and clears it after (None: unknown, as a server)."""
    _, beng, _ = setup
    gen = GenerationConfig(max_new_tokens=4, stop_on_eos=False)
    prompts = [*PROMPTS, *PROMPTS][:6]
    seen: list[int | None] = []
    run_batch(
        beng, [BatchRequest(p, gen) for p in prompts], on_step=lambda _: seen.append(beng.waiting)
    )
    assert seen[0] == len(prompts) - beng.bcfg.max_batch and seen[-1] == 0
    assert beng.waiting is None
