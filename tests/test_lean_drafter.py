"""The trained drafters' native-kernel forward (specpilot.drafters.lean): the same layer
outputs and cache writes as the module forward up to the kernels' summation order, the same
drafts, lossless speculation, and the module forward wherever autograd is on."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from specpilot import kernels
from specpilot.drafters.feature_net import FeatureNet, FeatureNetConfig
from specpilot.drafters.head import HeadDrafter
from specpilot.drafters.trained import shared_tables
from specpilot.engine import Engine, GenerationConfig
from specpilot.loading import LoadedModel, load_model
from specpilot.tree import TreeSpec

from .conftest import tiny_model
from .test_loading import VOCAB, write_gguf

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=kernels.unavailable_reason() or "kernels unavailable"
)

SPEC = TreeSpec(kind="dynamic", budget=12, topk=3, depth=5)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    tmp = tmp_path_factory.mktemp("lean_drafter")
    src = tiny_model("llama", seed=11, std=0.12, vocab=VOCAB, dim=64, intermediate_size=128)
    path = tmp / "t.gguf"
    write_gguf(path, src, quant={"token_embd.weight": T.Q8_0})
    return load_model(str(path), cache_dir=tmp / "c", weights="native")


def make_drafter(lm: LoadedModel, seed: int = 5, dense: bool = False) -> HeadDrafter:
    c = lm.model.cfg
    cfg = FeatureNetConfig(
        kind="head", dim=c.dim, vocab_size=c.vocab_size, taps=(1, 2), n_layers=2, n_heads=4,
        n_kv_heads=2, head_dim=16, intermediate_size=64, draft_vocab=0,
        extra={"target_fingerprint": lm.fingerprint},
    )  # fmt: skip
    net = FeatureNet(cfg)
    net.init_weights(seed, std=0.3)
    m = lm.model
    net.attach(*((m.model.embed_tokens.weight, m.head_weight()) if dense else shared_tables(m)))
    return HeadDrafter(net)


def module_forward(d: HeadDrafter, x: torch.Tensor, pos: torch.Tensor, start: int, kv_len: int,
                   mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    lean, d.lean = d.lean, None
    try:
        return d._run(x, pos, start, kv_len, mask)
    finally:
        d.lean = lean


def test_lean_layers_match_the_module_forward(target: LoadedModel) -> None:
    d = make_drafter(target)
    assert d.lean is not None  # CPU fp32, kernels built, every linear packed
    d._ensure(40)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # 12 committed entries, then 5 tree rows at slots 12..16 seeing a prefix and ancestors
        x0 = torch.randn(1, 12, 64, generator=g)
        pos0 = torch.arange(12)[None]
        causal = (torch.arange(12)[None, :] <= torch.arange(12)[:, None])[None]
        ref0 = module_forward(d, x0, pos0, 0, 12, causal)
        k_ref = [k.clone() for k in d._k]
        v_ref = [v.clone() for v in d._v]
        got0 = d._run(x0, pos0, 0, 12, causal)
        torch.testing.assert_close(got0, ref0, rtol=1e-4, atol=1e-4)
        for a, b in zip(d._k + d._v, k_ref + v_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        x1 = torch.randn(1, 5, 64, generator=g)
        pos1 = torch.tensor([[11, 12, 12, 13, 14]])
        mask = torch.zeros(1, 5, 17, dtype=torch.bool)
        mask[0, :, :12] = True
        for r, anc in enumerate([[12], [12, 13], [14], [12, 13, 15], [12, 13, 15, 16]]):
            mask[0, r, anc] = True
        ref1 = module_forward(d, x1, pos1, 12, 17, mask)
        got1 = d._run(x1, pos1, 12, 17, mask)
        torch.testing.assert_close(got1, ref1, rtol=1e-4, atol=1e-4)
        assert not torch.equal(got1[0, 0], got1[0, 1])  # the rows' masks differ


def test_lean_drafts_equal_the_module_drafts_and_stay_lossless(target: LoadedModel) -> None:
    engine = Engine(target.model)
    gen = GenerationConfig(max_new_tokens=16)
    lean, plain = make_drafter(target), make_drafter(target)
    plain.lean, plain.net.rownorm = None, None
    prompt = [3, 9, 4, 9, 4, 9, 1, 7]
    ref = engine.generate(prompt, gen).tokens
    a = engine.generate(prompt, gen, drafter=lean, spec=SPEC)
    assert a.tokens == ref and max(a.draft_nodes) > 0
    b = engine.generate(prompt, gen, drafter=plain, spec=SPEC)
    assert b.tokens == ref
    assert a.draft_nodes == b.draft_nodes and a.accept_lengths == b.accept_lengths


def test_autograd_keeps_the_module_norms(target: LoadedModel) -> None:
    """Training runs the net (on dense tables) with autograd on (head_unroll), also after a
    drafter set its row norms: the norms then are the modules' and their weights get
    gradients."""
    d = make_drafter(target, dense=True)
    assert d.net.rownorm is not None
    h = torch.randn(2, 64)
    with torch.enable_grad():
        d.net.norm.weight.requires_grad_(True)
        d.net.logits(h).float().sum().backward()
    assert d.net.norm.weight.grad is not None and d.net.norm.weight.grad.abs().sum() > 0
    with torch.no_grad():
        head = d.net.head_fn or (lambda x: x @ d.net.head.T)  # bf16 rows where oneDNN has them
        torch.testing.assert_close(d.net.logits(h), head(d.net.norm(h)), rtol=1e-5, atol=1e-5)


def test_no_lean_forward_off_fp32(target: LoadedModel) -> None:
    from specpilot.drafters.lean import lean_forward

    d = make_drafter(target)
    assert lean_forward(d.net) is not None
    d.net.to(torch.bfloat16)
    assert lean_forward(d.net) is None
