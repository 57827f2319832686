"""Gemma 3 (text): parity with Hugging Face transformers on tiny seeded random models, the
sliding window past its end (plain and speculative decoding agree with chain and tree drafts),
Hugging Face directories and GGUF files (tensor names, the +1 norm shift, the SentencePiece
vocabulary checked against transformers' own GGUF tokenizer), BOS and chat-less prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from specpilot.config import ModelConfig
from specpilot.drafters import make_drafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.errors import ConfigError
from specpilot.loading import load_model
from specpilot.loading.hf import build_model
from specpilot.model import Transformer, causal_mask
from specpilot.peers.hf import HFGreedy
from specpilot.tree import TreeSpec

VOCAB = 160
WINDOW = 8
SEQ = 21  # past the window: sliding layers see only the last 8 keys
NEW = 32


def hf_config(**kw: Any) -> Any:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    base.update(kw)
    return transformers.Gemma3TextConfig(**base)


def hf_model(seed: int = 0, std: float = 0.1, **kw: Any) -> Any:
    """A seeded random Gemma3ForCausalLM (fp32, eager attention); norms near Gemma's 1 + 0 and
    a small tied embedding (it is scaled by sqrt(hidden): a large one makes greedy repeat)."""
    cfg = hf_config(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = transformers.Gemma3ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else (0.02 if "embed" in name else std)
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return m


def ours_from(hf: Any) -> Transformer:
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    return build_model(cfg, hf.state_dict(), "cpu", torch.float32, "test")


def prompt(n: int = SEQ, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def our_logits(m: Transformer, ids: list[int]) -> torch.Tensor:
    t = len(ids)
    with torch.no_grad():
        out = m(torch.tensor([ids]), torch.arange(t)[None], 0, t, causal_mask(0, t, t, m.device))
    return out.logits[0]


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


# -- config --------------------------------------------------------------------------------------


def test_config_from_hf_and_back() -> None:
    cfg = ModelConfig.from_hf(hf_config().to_dict())
    assert cfg.arch == "gemma3" and cfg.gemma and cfg.qk_norm and cfg.tie_embeddings
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (WINDOW, 1e6, 1e4)
    assert cfg.query_pre_attn_scalar == 24 and cfg.head_dim == 16
    again = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert ModelConfig.from_hf(again.to_dict()) == cfg
    legacy = {  # transformers 4 spelling: rope_theta / rope_local_base_freq, pattern of 6
        k: v for k, v in hf_config().to_dict().items() if k not in ("rope_parameters", "layer_types")
    }
    legacy.update(rope_theta=1e6, rope_local_base_freq=1e4, num_hidden_layers=7)
    old = ModelConfig.from_hf(legacy)
    assert old.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")


def test_multimodal_and_unsupported_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="multimodal Gemma 3"):
        ModelConfig.from_hf({"model_type": "gemma3", "text_config": {}})
    d = hf_config().to_dict()
    with pytest.raises(ConfigError, match="soft-capping"):
        ModelConfig.from_hf({**d, "attn_logit_softcapping": 50.0})
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf({**d, "layer_types": ["sliding_attention"]})


# -- parity with transformers --------------------------------------------------------------------


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_logits_match_hf(softcap: float | None) -> None:
    hf = hf_model(final_logit_softcapping=softcap)
    ours = ours_from(hf)
    ids = prompt()
    ref = hf_logits(hf, ids)
    for attention, linear in (("sdpa", "torch"), ("exact", "onednn")):
        m = ours_from(hf)
        m.prepack(linear)
        m.setup_cache(SEQ + 4, attention=attention)
        torch.testing.assert_close(our_logits(m, ids), ref, rtol=0, atol=2e-5)
    # the window matters: without it the last rows differ, before it they are the same
    wide = build_model(
        ModelConfig.from_hf(hf_config(sliding_window=64, final_logit_softcapping=softcap).to_dict()),
        ours.state_dict(),
        "cpu",
        torch.float32,
        "test",
    )
    wide.setup_cache(SEQ)
    lw = our_logits(wide, ids)
    torch.testing.assert_close(lw[:WINDOW], ref[:WINDOW], rtol=0, atol=2e-5)
    assert (lw[-1] - ref[-1]).abs().max() > 1e-3


def test_norms_are_bitwise_hf() -> None:
    hf = hf_model()
    ours = ours_from(hf)
    x = torch.randn(3, 5, 64)
    layer, ref = ours.model.layers[0], hf.model.layers[0]
    for name in ("input_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        assert torch.equal(getattr(layer, name)(x), getattr(ref, name)(x)), name
    e = torch.tensor([[3, 7, 11]])
    ours.setup_cache(4)
    got = ours(e, torch.arange(3)[None], 0, 3, hidden_layers=(0,), logits_rows=slice(0, 0))
    assert torch.equal(got.hidden[0], hf.model.embed_tokens(e))


def test_greedy_tokens_equal_hf_past_the_window() -> None:
    hf = hf_model(seed=1)
    ours = ours_from(hf)
    ids = prompt(seed=1)
    theirs = HFGreedy(hf).generate(ids, NEW, ())
    assert len(set(theirs)) > NEW // 4, "degenerate test model: greedy path barely varies"
    engine = Engine(ours, EngineConfig(attention="exact", linear="onednn"))
    gen = GenerationConfig(max_new_tokens=NEW, stop_on_eos=False)
    assert engine.generate(ids, gen).tokens == theirs


# -- speculative == plain past the window --------------------------------------------------------

SPECS = {
    "chain": TreeSpec(kind="chain", k=10),  # deeper than the window: tree keys masked by position
    "static": TreeSpec(kind="static", paths=((0,), (1,), (0, 0), (0, 1), (0, 0, 0))),
    "dynamic": TreeSpec(kind="dynamic", budget=10, topk=3, depth=5),
}


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("drafter", ["model-copy", "suffix"])
def test_speculative_equals_plain_past_the_window(kind: str, drafter: str) -> None:
    hf = hf_model(seed=2)
    target = ours_from(hf)
    eng = Engine(target, EngineConfig(attention="exact"))
    gen = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    prompts = [prompt(seed=2), [5, 6, 7, 8] * 4, [9]]
    d = make_drafter("model", draft=ours_from(hf)) if drafter == "model-copy" else None
    for ids in prompts:
        ref = eng.generate(ids, gen).tokens
        dr = d if d is not None else make_drafter("suffix")
        res = eng.generate(ids, gen, drafter=dr, spec=SPECS[kind])
        assert res.tokens == ref, f"{drafter}/{kind} diverged on {ids}"
        if drafter == "model-copy":
            assert res.tau >= 2.0
