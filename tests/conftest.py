"""Shared fixtures: tiny deterministic models built from a config in the test suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from specpilot.config import ModelConfig
from specpilot.model import Transformer, init_weights

torch.set_num_threads(2)


def tiny_config(arch: str = "llama", vocab: int = 64, **kw: object) -> ModelConfig:
    base = dict(
        arch=arch,
        vocab_size=vocab,
        dim=48,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        intermediate_size=96,
        max_position=512,
        tie_embeddings=arch == "llama",
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
    )
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def tiny_model(arch: str = "llama", seed: int = 0, std: float = 0.2, **kw: object) -> Transformer:
    m = Transformer(tiny_config(arch, **kw))
    m.tie_weights()
    init_weights(m, seed, std=std)
    m.eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@pytest.fixture
def llama_tiny() -> Transformer:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread in this process for a module: its own decoding (references, in-process
    runs) goes on beside trial children on the same 2 cores, where two threads wait on each other
    for every tiny op; the children run one thread each, so outputs are computed alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
