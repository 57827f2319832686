"""Speculative output equals plain greedy output for every drafter and every tree shape,
including prompts where nothing is accepted and drafters whose every draft is accepted."""

from __future__ import annotations

import pytest
import torch

from specpilot.drafters import make_drafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.model import Transformer
from specpilot.tree import TreeSpec

from .conftest import tiny_model

SPECS = {
    "chain": TreeSpec(kind="chain", k=4),
    "static": TreeSpec(kind="static", paths=((0,), (1,), (0, 0), (0, 1), (0, 0, 0))),
    "dynamic": TreeSpec(kind="dynamic", budget=10, topk=3, depth=5),
}
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],  # repetitive: lookup and suffix drafts get accepted
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [42],
]
GEN = GenerationConfig(max_new_tokens=40, stop_on_eos=False)


def _target() -> Transformer:
    return tiny_model("llama", seed=7, std=0.12, tie_embeddings=False)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return _target()


@pytest.fixture(scope="module")
def references(target: Transformer) -> list[list[int]]:
    eng = Engine(target, EngineConfig(attention="exact"))
    return [eng.generate(p, GEN).tokens for p in PROMPTS]


def _drafter(name: str):
    if name in ("lookup", "suffix"):
        return make_drafter(name)
    draft = _target()  # same weights as the target: every draft is accepted
    if name == "model-anti":  # negated LM head: its top-k are the target's bottom-k
        with torch.no_grad():
            draft.lm_head.weight.neg_()
    return make_drafter("model", draft=draft)


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("name", ["lookup", "suffix", "model-copy", "model-anti"])
def test_speculative_equals_ar(
    target: Transformer, references: list[list[int]], name: str, kind: str
) -> None:
    eng = Engine(target, EngineConfig(attention="exact"))
    drafter = _drafter(name)
    spec = SPECS[kind]
    taus = []
    for prompt, ref in zip(PROMPTS, references, strict=True):
        res = eng.generate(prompt, GEN, drafter=drafter, spec=spec)
        assert res.tokens == ref, f"{name}/{kind} diverged on prompt {prompt}"
        taus.append(res.tau)
    if name == "model-copy":  # everything accepted
        assert min(taus) >= 2.0
    if name == "model-anti":  # nothing accepted: exactly plain decoding
        assert taus == [1.0] * len(PROMPTS)
