"""Tiny LoadedModels for plan-runtime and mechanism tests (built in memory, no files)."""

from __future__ import annotations

from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.loading import LoadedModel

from .conftest import tiny_model
from .test_loading import VOCAB
from .test_tokenizer import tiny_tokenizer

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],  # repetitive: lookup and suffix drafts get accepted
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [42],
]
GEN = GenerationConfig(max_new_tokens=32, stop_on_eos=False)


def loaded(seed: int = 7) -> LoadedModel:
    """A fresh tiny target (untied head, varied greedy output) with the tiny tokenizer."""
    m = tiny_model("llama", seed=seed, std=0.12, tie_embeddings=False, vocab=VOCAB)
    return LoadedModel(m, tiny_tokenizer(), m.cfg, f"tiny-{seed}", f"fp-{seed}")


def references() -> list[list[int]]:
    """Plain greedy AR output of :func:`loaded` with the default engine, per prompt."""
    eng = Engine(loaded().model, EngineConfig())
    return [eng.generate(p, GEN).tokens for p in PROMPTS]
