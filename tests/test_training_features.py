"""How distillation stores a target's features: fp16 or bf16 shards, per-tap normalization."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specpilot.drafters.feature_net import FeatureNet, FeatureNetConfig
from specpilot.drafters.head import head_unroll
from specpilot.drafters.trained import load_trained_drafter
from specpilot.engine import Engine, GenerationConfig
from specpilot.loading import load_model
from specpilot.training.distill import _features, _State, train_drafter, work_dir
from specpilot.training.features import feature_format
from specpilot.tree import TreeSpec

from .test_loading import make_model, save_dir
from .test_training import _cfg, _prompts

WINDOWS = [[5, 6, 7, 8, 9, 10], [40, 41, 40, 41]]


def _loud_target(tmp: Path) -> Path:
    """A tiny target whose residual stream runs past fp16's range (as Gemma 3's middle layers):
    the embedding scaled by 2e5, so layer inputs reach ~1e5 while the final normed state stays
    O(1)."""
    model = make_model("llama-tied", seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2e5)
    return save_dir(tmp / "loud", model)


def test_feature_format_of_a_quiet_and_a_loud_target(tmp_path: Path) -> None:
    quiet = load_model(str(save_dir(tmp_path / "quiet", make_model("llama-tied", seed=3))))
    n = quiet.cfg.n_layers
    fmt = feature_format(quiet.model, WINDOWS, (1, n), (1, n))
    assert fmt["dtype"] == "float16" and fmt["tap_norm"] is False, fmt
    loud = load_model(str(_loud_target(tmp_path)))
    fmt = feature_format(loud.model, WINDOWS, (1, n), (1, n))
    assert fmt["dtype"] == "bfloat16" and fmt["tap_norm"] is True, fmt
    assert fmt["max_abs"] > 65504 / 8 and fmt["tap_rms"][0] > 32 * fmt["tap_rms"][1]


def test_work_directory_from_before_the_choice_keeps_fp16(tmp_path: Path) -> None:
    lm = load_model(str(save_dir(tmp_path / "t", make_model("llama-tied", seed=3))))
    st = _State(tmp_path / "state.json")
    st.d["shards"] = 3  # data from a run that did not record the format
    cfg = _cfg(_prompts(tmp_path))
    fmt = _features(lm.model, lm.tokenizer, [], cfg, (1, 2), (1, 2), tmp_path, st)
    assert fmt == {"dtype": "float16", "tap_norm": False}
    assert json.loads((tmp_path / "state.json").read_text())["features"] == fmt


def test_tap_norm_makes_the_feature_scale_free() -> None:
    cfg = FeatureNetConfig(
        kind="head", dim=32, vocab_size=64, taps=(1, 2), n_heads=4, n_kv_heads=2, head_dim=8,
        intermediate_size=48, tap_norm=True,
    )  # fmt: skip
    net = FeatureNet(cfg)
    net.init_weights(0)
    emb = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    net.attach(emb, emb)
    taps = torch.randn(2, 7, 2, 32, generator=torch.Generator().manual_seed(2))
    scaled = taps * torch.tensor([3e4, 0.5])[None, None, :, None]
    torch.testing.assert_close(net.feature(scaled), net.feature(taps), rtol=1e-4, atol=1e-5)
    toks = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    a = head_unroll(net, taps, toks, 3)
    b = head_unroll(net, scaled, toks, 3)
    for (la, oa), (lb, ob) in zip(a, b, strict=True):
        assert torch.equal(oa, ob)
        torch.testing.assert_close(lb, la, rtol=1e-3, atol=1e-3)
    plain = FeatureNet(FeatureNetConfig(**{**cfg.to_json(), "tap_norm": False}))
    plain.load_state_dict(net.state_dict())
    plain.attach(emb, emb)
    assert not torch.allclose(plain.feature(scaled), plain.feature(taps))


@pytest.mark.parametrize("tap_norm", ["auto", "off"])
def test_training_a_loud_target_stores_bf16_and_stays_lossless(
    tmp_path: Path, tap_norm: str
) -> None:
    lm = load_model(str(_loud_target(tmp_path)))
    out = tmp_path / "drafter"
    cfg = _cfg(_prompts(tmp_path, 16), max_steps=4, eval_prompts=2, tap_norm=tap_norm)
    train_drafter(lm, cfg, out)
    state = json.loads((work_dir(out) / "state.json").read_text())
    assert state["features"]["dtype"] == "bfloat16"
    shard = load_file(str(next((work_dir(out) / "data").glob("shard_*.safetensors"))))
    assert shard["feats"].dtype == torch.bfloat16 and torch.isfinite(shard["feats"]).all()
    record = json.loads((out / "training_record.json").read_text())
    assert record["data"]["features"] == state["features"]
    saved = json.loads((out / "config.json").read_text())
    assert saved["tap_norm"] is (tap_norm == "auto")
    drafter = load_trained_drafter(out, lm)
    assert drafter.net.cfg.tap_norm is (tap_norm == "auto")
    engine = Engine(lm.model)
    ref = engine.generate([5, 6, 7, 8], GenerationConfig(max_new_tokens=12)).tokens
    spec = TreeSpec(kind="dynamic", budget=8)
    got = engine.generate([5, 6, 7, 8], GenerationConfig(max_new_tokens=12), drafter, spec)
    assert got.tokens == ref
