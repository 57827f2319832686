"""Parity with Hugging Face transformers: logits and greedy tokens on tiny random models.

Covers the Llama family's variants: Llama with tied embeddings, Llama with llama3 RoPE scaling,
Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm). Also checks the HF peer wrappers.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("transformers")

from specpilot.config import ModelConfig
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.errors import ConfigError, SpecPilotError
from specpilot.model import Transformer, causal_mask, init_weights
from specpilot.peers.hf import (
    PEER_NAMES,
    HFAssisted,
    HFGreedy,
    HFPromptLookup,
    build_hf_model,
    make_hf_peers,
)

VOCAB = 160
SEQ = 24
NEW = 32
# std 0.2 keeps greedy paths diverse with top-1/top-2 margins >= 3e-3 on these seeds, four
# orders of magnitude above the ~1e-7 kernel differences between the two implementations.
STD = 0.2
_BASE = dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128)
_LLAMA3 = (
    ("factor", 8.0),
    ("high_freq_factor", 4.0),
    ("low_freq_factor", 1.0),
    ("original_max_position_embeddings", 32),
    ("rope_type", "llama3"),
)
CONFIGS = {
    "llama-tied": ModelConfig(arch="llama", tie_embeddings=True, **_BASE),
    "llama3-rope": ModelConfig(arch="llama", rope_theta=500000.0, rope_scaling=_LLAMA3, **_BASE),
    "qwen2-bias": ModelConfig(arch="qwen2", qkv_bias=True, rope_theta=1e6, **_BASE),
    "qwen3-qknorm": ModelConfig(arch="qwen3", qk_norm=True, rope_theta=1e6, **_BASE),
}


def _pair(name: str, seed: int = 1) -> tuple[Transformer, torch.nn.Module]:
    """Our model (not prepacked) and the HF model holding the same weights."""
    ours = Transformer(CONFIGS[name])
    ours.tie_weights()
    init_weights(ours, seed, std=STD)
    ours.eval()
    return ours, build_hf_model(ours.cfg, ours.state_dict())


def _prompt(n: int = SEQ, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _our_logits(ours: Transformer, ids: list[int]) -> torch.Tensor:
    t = len(ids)
    with torch.no_grad():
        out = ours(
            torch.tensor([ids]), torch.arange(t)[None], 0, t, causal_mask(0, t, t, ours.device)
        )
    return out.logits[0]  # (T, vocab)


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # (T, vocab)


def _engine_greedy(ours: Transformer, prompt: list[int], eos: tuple[int, ...] = ()) -> list[int]:
    engine = Engine(ours, EngineConfig(attention="exact", linear="onednn"))
    gen = GenerationConfig(max_new_tokens=NEW, stop_on_eos=bool(eos))
    return engine.generate(prompt, gen, drafter=None, eos_ids=eos).tokens


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_equal_hf_sdpa(name: str) -> None:
    ours, hf = _pair(name)
    ours.prepack("torch")
    ours.setup_cache(SEQ, attention="sdpa")
    ids = _prompt()
    assert torch.equal(_our_logits(ours, ids), _hf_logits(hf, ids))


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_close_to_hf_exact_onednn(name: str) -> None:
    ours, hf = _pair(name)
    ours.prepack("onednn")
    ours.setup_cache(SEQ, attention="exact")
    ids = _prompt()
    torch.testing.assert_close(_our_logits(ours, ids), _hf_logits(hf, ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_equal_hf(name: str) -> None:
    ours, hf = _pair(name)
    prompt = _prompt()
    theirs = HFGreedy(hf).generate(prompt, NEW, ())
    assert len(theirs) == NEW
    assert len(set(theirs)) > NEW // 4, "degenerate test model: greedy path barely varies"
    assert _engine_greedy(ours, prompt) == theirs


def test_tied_state_dict_without_lm_head() -> None:
    ours, hf = _pair("llama-tied")
    sd = {k: v for k, v in ours.state_dict().items() if k != "lm_head.weight"}
    hf2 = build_hf_model(ours.cfg, sd)
    assert hf2.lm_head.weight is hf2.model.embed_tokens.weight
    assert torch.equal(hf2.lm_head.weight, hf.lm_head.weight)


def test_untied_state_dict_must_be_complete() -> None:
    ours, _ = _pair("qwen3-qknorm")
    sd = {k: v for k, v in ours.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="lm_head"):
        build_hf_model(ours.cfg, sd)


def test_eos_stops_hf_peers_like_engine() -> None:
    ours, hf = _pair("qwen2-bias")
    prompt = _prompt()
    full = HFGreedy(hf).generate(prompt, NEW, ())
    eos = full[9]
    cut = full[: full.index(eos) + 1]
    for peer in (HFGreedy(hf), HFPromptLookup(hf, n=4), HFAssisted(hf, hf, num_assistant_tokens=4)):
        assert peer.generate(prompt, NEW, (eos, VOCAB - 1)) == cut, peer.name
    assert _engine_greedy(ours, prompt, eos=(eos,)) == cut


def test_prompt_lookup_and_assisted_match_greedy() -> None:
    _, hf = _pair("llama3-rope")
    _, draft = _pair("llama3-rope", seed=2)
    greedy = HFGreedy(hf)
    # A prompt that repeats itself, so prompt lookup finds n-gram matches and drafts.
    prompt = _prompt(8) * 3
    ref = greedy.generate(prompt, NEW, ())
    assert HFPromptLookup(hf).generate(prompt, NEW, ()) == ref
    assert HFAssisted(hf, draft, num_assistant_tokens=5).generate(prompt, NEW, ()) == ref
    assert greedy.generate(prompt, 5, ()) == ref[:5]


def test_loaded_generation_config_is_ignored() -> None:
    _, hf = _pair("qwen3-qknorm")
    prompt = _prompt()
    ref = HFGreedy(hf).generate(prompt, NEW, ())
    hf.generation_config.repetition_penalty = 5.0
    hf.generation_config.eos_token_id = ref[3]
    hf.generation_config.suppress_tokens = [ref[0]]
    assert HFGreedy(hf).generate(prompt, NEW, ()) == ref
    assert hf.generation_config.repetition_penalty == 5.0  # restored after the call


def test_make_hf_peers() -> None:
    _, hf = _pair("llama-tied")
    assert [p.name for p in make_hf_peers(hf)] == ["hf-greedy", "hf-prompt-lookup"]
    peers = make_hf_peers(hf, PEER_NAMES, draft=hf)
    assert [p.name for p in peers] == ["hf-greedy", "hf-prompt-lookup", "hf-assisted"]
    with pytest.raises(ConfigError, match="draft"):
        make_hf_peers(hf, ["assisted"])
    with pytest.raises(ConfigError, match="unknown hf peer"):
        make_hf_peers(hf, ["beam"])


def test_missing_transformers_is_actionable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SpecPilotError, match=r"pip install 'specpilot\[hf\]'"):
        build_hf_model(CONFIGS["llama-tied"], {})
