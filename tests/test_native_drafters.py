"""Trained drafters on a native GGUF target: the target's embedding and LM head are used in place
(no fp32 copy), the draft-vocabulary head runs on block rows with the kernel's bits, drafts match
the dense path's, and speculative output equals plain greedy output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from specpilot import kernels
from specpilot.drafters.block import BlockDrafter
from specpilot.drafters.feature_net import FeatureNet, FeatureNetConfig, draft_rows
from specpilot.drafters.head import HeadDrafter
from specpilot.drafters.trained import load_trained_drafter, save_drafter, shared_tables
from specpilot.engine import Engine, GenerationConfig
from specpilot.errors import DrafterError
from specpilot.loading import LoadedModel, load_model, native
from specpilot.tree import TreeSpec

from .conftest import tiny_model
from .test_loading import VOCAB, write_gguf

pytestmark = pytest.mark.skipif(
    not kernels.available(), reason=kernels.unavailable_reason() or "kernels unavailable"
)

TAPS = (1, 2)
SPEC = TreeSpec(kind="dynamic", budget=12, topk=3, depth=5)
PROMPTS = ([1, 5, 9, 2, 7], [3, 3, 4, 3, 3, 4, 3])


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    """Native tiny targets: tied (Q8_0 embedding = head) and untied (Q4_0 output)."""
    tmp = tmp_path_factory.mktemp("native_drafters")
    out = {}
    for kind, seed in (("tied", 7), ("untied", 8)):
        src = tiny_model("llama", seed=seed, std=0.12, vocab=VOCAB, dim=64, intermediate_size=128,
                         tie_embeddings=kind == "tied")  # fmt: skip
        quant = {"token_embd.weight": T.Q8_0}
        if kind == "untied":
            quant["output.weight"] = T.Q4_0
        path = tmp / f"{kind}.gguf"
        write_gguf(path, src, quant=quant)
        lm = load_model(str(path), cache_dir=tmp / "c", weights="native")
        assert lm.model.native and native.fp32_copy_bytes(lm.model) == 0
        out[kind] = lm
    return out


def make_net(kind: str, lm: LoadedModel, draft_vocab: int = 40, seed: int = 4) -> FeatureNet:
    c = lm.model.cfg
    cfg = FeatureNetConfig(
        kind=kind, dim=c.dim, vocab_size=c.vocab_size, taps=TAPS, n_layers=1, n_heads=4,
        n_kv_heads=2, head_dim=16, intermediate_size=64, block=4 if kind == "block" else 0,
        draft_vocab=draft_vocab, extra={"target_fingerprint": lm.fingerprint},
    )  # fmt: skip
    net = FeatureNet(cfg)
    net.init_weights(seed, std=0.3)
    if draft_vocab:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randperm(c.vocab_size, generator=g)[:draft_vocab].sort().values
        net.vocab_ids.copy_(ids)
    return net


@pytest.mark.parametrize("kind", ["tied", "untied"])
@pytest.mark.parametrize("draft_vocab", [40, 0])
def test_head_drafts_in_place_without_fp32_copies_and_stays_lossless(
    targets: dict[str, LoadedModel], kind: str, draft_vocab: int
) -> None:
    lm = targets[kind]
    m = lm.model
    net = make_net("head", lm, draft_vocab)
    keys = set(net.state_dict())
    net.attach(*shared_tables(m))
    emb, head = net.native
    assert emb is m.model.embed_tokens and net.embed is None and net.head is None
    assert isinstance(head, kernels.GGUFLinear)
    assert (head is m.lm_head) == (draft_vocab == 0)  # the whole vocabulary: the target's head
    assert set(net.state_dict()) == keys  # the target's blocks are not the drafter's weights
    drafter = HeadDrafter(net)
    engine = Engine(m)
    gen = GenerationConfig(max_new_tokens=20)
    for prompt in PROMPTS:
        ref = engine.generate(prompt, gen).tokens
        res = engine.generate(prompt, gen, drafter=drafter, spec=SPEC)
        assert res.tokens == ref
        assert max(res.draft_nodes) > 0
    assert drafter.forwards > 10
    assert native.fp32_copy_bytes(m) == 0


def test_native_numerics_match_the_dense_tables(targets: dict[str, LoadedModel]) -> None:
    """Embedding rows are the dequantized rows bit for bit; the draft-vocabulary head gives the
    full native head's bits on those rows and the dense logits up to summation order."""
    m = targets["untied"].model
    net = make_net("head", targets["untied"])
    ids = net.vocab_ids
    head = draft_rows(m.lm_head, ids)
    assert head.blocks.numel() == ids.numel() * m.lm_head.blocks.numel() // m.cfg.vocab_size
    x = torch.randn(5, m.cfg.dim, generator=torch.Generator().manual_seed(0))
    assert torch.equal(head(x), m.lm_head(x)[:, ids])  # rows are independent (the contract)
    net.attach(*shared_tables(m))
    toks = torch.tensor([[3, 17, 40, 5]])
    g = torch.randn(1, 4, m.cfg.dim, generator=torch.Generator().manual_seed(1))
    got_in, got_logits = net.step_input(g, toks), net.logits(g)
    assert native.fp32_copy_bytes(m) == 0
    from specpilot.costmodel.roofline import trained_drafter_work

    own = sum(p.numel() for n, p in net.named_parameters() if n.startswith(("in_proj", "layers")))
    work = trained_drafter_work(net, 1.0)  # the floor reads the head rows' block bytes
    assert work.bytes == own * 4 + net.native[1].blocks.numel()
    assert work.flops == 2 * (own + ids.numel() * m.cfg.dim)
    dense = make_net("head", targets["untied"])
    dense.attach(m.model.embed_tokens.weight, m.head_weight())  # asks for the fp32 copies
    assert native.fp32_copy_bytes(m) > 0
    assert dense.native == (None, None) and dense.head is not None
    assert torch.equal(got_in, dense.step_input(g, toks))
    torch.testing.assert_close(got_logits, dense.logits(g), rtol=1e-5, atol=1e-5)
    for mod in (m.model.embed_tokens, m.lm_head):  # drop the copies for the other tests
        mod._dense = None


def test_block_drafter_and_saved_head_load_in_place(
    targets: dict[str, LoadedModel], tmp_path: Path
) -> None:
    lm = targets["tied"]
    m = lm.model
    engine = Engine(m)
    gen = GenerationConfig(max_new_tokens=16)
    saved = save_drafter(make_net("head", lm), tmp_path / "head", {"test": True},
                         dtype=torch.float32)  # fmt: skip
    head = load_trained_drafter(saved, lm)
    assert isinstance(head, HeadDrafter) and head.net.native[0] is m.model.embed_tokens
    assert native.fp32_copy_bytes(m) == 0
    with pytest.raises(DrafterError, match="attach"):  # a block drafter: attach first
        BlockDrafter(make_net("block", lm))
    net = make_net("block", lm)
    net.attach(*shared_tables(m))
    block = BlockDrafter(net)
    for drafter in (head, block):
        for prompt in PROMPTS:
            ref = engine.generate(prompt, gen).tokens
            assert engine.generate(prompt, gen, drafter=drafter, spec=SPEC).tokens == ref
    assert native.fp32_copy_bytes(m) == 0


def test_shipped_precision_linears_run_on_f16_blocks(
    targets: dict[str, LoadedModel], tmp_path: Path
) -> None:
    """A drafter saved in fp16 (as shipped) on a native target packs its linears as F16
    GGUFLinears (the same values, half the bytes); other weights keep the oneDNN copies."""
    from specpilot.costmodel.roofline import trained_drafter_work

    lm = targets["untied"]
    m = lm.model
    saved = save_drafter(make_net("head", lm), tmp_path / "head16", {"test": True})
    drafter = load_trained_drafter(saved, lm)
    net = drafter.net
    assert net.half_weights
    from specpilot.drafters import feature_net

    fast = [f for mod in (net, *net.layers) for _, f in mod.fast.values()]
    half = [f.native if isinstance(f, feature_net._RowSwitch) else f for f in fast]
    assert len(fast) == 6 and all(isinstance(f, kernels.GGUFLinear) for f in half)
    assert all(f.qtype == kernels.QTYPES["F16"] for f in half)
    assert feature_net._bf16_gemm() == all(isinstance(f, feature_net._RowSwitch) for f in fast)
    lin, qkv = net.layers[0].qkv, net.layers[0].fast["qkv"][1]
    for rows in (1, feature_net.BF16_FROM_ROWS - 1, feature_net.BF16_FROM_ROWS, 20):
        x = torch.randn(rows, m.cfg.dim, generator=torch.Generator().manual_seed(rows))
        exact = rows < feature_net.BF16_FROM_ROWS or not feature_net._bf16_gemm()
        tol = 1e-5 if exact else 2e-2  # wide calls on bf16 (drafts only)
        torch.testing.assert_close(qkv(x), lin(x), rtol=tol, atol=tol)
    own = sum(p.numel() for n, p in net.named_parameters() if n.startswith(("in_proj", "layers")))
    big = sum(p.numel() for n, p in net.named_parameters()
              if n.startswith(("in_proj", "layers")) and p.dim() == 2)  # fmt: skip
    work = trained_drafter_work(net, 1.0)
    assert work.bytes == (own - big) * 4 + big * 2 + net.native[1].blocks.numel()
    engine = Engine(m)
    gen = GenerationConfig(max_new_tokens=16)
    for prompt in PROMPTS:
        ref = engine.generate(prompt, gen).tokens
        assert engine.generate(prompt, gen, drafter=drafter, spec=SPEC).tokens == ref
    assert native.fp32_copy_bytes(m) == 0
    dense_target = tiny_model("llama", seed=8, vocab=m.cfg.vocab_size, dim=m.cfg.dim,
                              intermediate_size=128)  # fmt: skip
    other = load_trained_drafter(saved, dense_target)  # an fp32 target: the oneDNN copies
    assert not other.net.half_weights and other.net.native == (None, None)


def test_int8_profile_runs_the_drafter_linears_as_q8_0(
    targets: dict[str, LoadedModel], tmp_path: Path
) -> None:
    """In the int8 numerics profile a drafter's linears are Q8_0 GGUFLinears in that profile
    (quantized from its weights: close to the module's output, each row's bits independent of
    the rows in the call), counted as such by the floor; speculation stays lossless."""
    from specpilot.costmodel.roofline import trained_drafter_work
    from specpilot.drafters import feature_net
    from specpilot.engine import EngineConfig

    lm = targets["untied"]
    m = lm.model
    saved = save_drafter(make_net("head", lm), tmp_path / "head8", {"test": True})
    engine = Engine(m, EngineConfig(numerics="int8"))
    try:
        drafter = load_trained_drafter(saved, lm)
        net = drafter.net
        assert net.q8_weights and not net.half_weights
        fast = [f for mod in (net, *net.layers) for _, f in mod.fast.values()]
        q8 = [f.native if isinstance(f, feature_net._RowSwitch) else f for f in fast]
        assert len(fast) == 6
        assert all(isinstance(f, kernels.GGUFLinear) and f.qtype == 8 and f.int8 for f in q8)
        assert feature_net._bf16_gemm() == all(isinstance(f, feature_net._RowSwitch) for f in fast)
        lin, gu = net.layers[0].gate_up, net.layers[0].fast["gate_up"][1]
        x = torch.randn(feature_net.BF16_FROM_ROWS_Q8 + 2, m.cfg.dim,
                        generator=torch.Generator().manual_seed(3))  # fmt: skip
        q8_rows = feature_net.BF16_FROM_ROWS_Q8 - 1
        want, got = lin(x), gu(x[:q8_rows])
        err = (got - want[:q8_rows]).norm() / want[:q8_rows].norm()
        assert float(err) < 0.03  # Q8 weights and activations
        for rows in (1, 4, 7, 20):
            assert torch.equal(gu(x[:rows]), got[:rows])  # the int8 kernel's bits at any width
        wide = gu(x)  # bf16 where the CPU has it (drafts only)
        assert float((wide - want).norm() / want.norm()) < 0.03
        big = sum(p.numel() for n, p in net.named_parameters()
                  if n.startswith(("in_proj", "layers")) and p.dim() == 2)  # fmt: skip
        own = sum(p.numel() for n, p in net.named_parameters()
                  if n.startswith(("in_proj", "layers")))  # fmt: skip
        head = net.native[1]
        work = trained_drafter_work(net, 1.0)
        assert work.bytes == (own - big) * 4 + big * 34 // 32 + head.blocks.numel()
        assert work.int8_flops == 2.0 * (big + head.out_features * head.in_features * head.int8)
        gen = GenerationConfig(max_new_tokens=16)
        for prompt in PROMPTS:
            ref = engine.generate(prompt, gen).tokens
            assert engine.generate(prompt, gen, drafter=drafter, spec=SPEC).tokens == ref
    finally:
        m.set_numerics("fp32")


def test_default_plan_on_native_weights_uses_the_goodput_budget(
    targets: dict[str, LoadedModel],
) -> None:
    from specpilot.runtime import build, default_plan

    plan = default_plan(targets["tied"])
    assert plan.engine.goodput and plan.drafter == "suffix"
    built = build(plan, targets["tied"])
    gen = GenerationConfig(max_new_tokens=12)
    plain = Engine(targets["tied"].model)
    for p in PROMPTS:
        ref = plain.generate(list(p), gen).tokens
        res = built.engine.generate(list(p), gen, drafter=built.make_drafter(), spec=built.spec)
        assert res.tokens == ref


def test_bench_flags_default_to_goodput_on_native_weights(
    targets: dict[str, LoadedModel],
) -> None:
    from specpilot.cli import build_parser
    from specpilot.plan_setup import flag_plans

    lm = targets["tied"]
    for flags, want in (([], True), (["--no-goodput"], False), (["--goodput"], True),
                        (["--drafter", "lookup"], True)):  # fmt: skip
        args = build_parser().parse_args(["bench", *flags])
        assert [p.engine.goodput for _, p in flag_plans(args, lm)] == [want], flags


STATIC = TreeSpec(kind="static", paths=((0,), (1,), (0, 0), (0, 1)))


@pytest.mark.parametrize("spec", [SPEC, TreeSpec(kind="chain", k=4), STATIC])
def test_heads_drafting_together_draft_what_each_drafts_alone(
    targets: dict[str, LoadedModel], spec: TreeSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """propose_all batches heads over one net into one forward per depth; on weights the native
    kernels run (batch-invariant; no bf16 switch) every sequence's tree is bit for bit its tree
    drafted alone, whatever the others' lengths, new entries and depths (some stop early)."""
    from specpilot.drafters import feature_net
    from specpilot.drafters.base import DraftContext, propose_all

    monkeypatch.setattr(feature_net, "BF16_FROM_ROWS", 10**9)  # the F16 kernel at every width
    lm = targets["tied"]
    m = lm.model
    net = make_net("head", lm, 40, seed=9)
    with torch.no_grad():
        for p in net.parameters():  # fp16-exact weights: the draft layers run as F16 kernels
            p.copy_(p.half().float())
    net.attach(*shared_tables(m))
    engine = Engine(m)
    prompts = [[1, 5, 9, 2, 7], [3, 3, 4, 3, 3, 4, 3], [8, 1], [2, 9, 9, 4, 1, 6, 5, 5, 3]]
    gen = GenerationConfig(max_new_tokens=20)
    full = [engine.generate(p, gen).tokens for p in prompts]
    cut = [0.0, 0.03, 0.0, 0.05]  # some trees stop early
    together = [HeadDrafter(net, min_prob=c) for c in cut]
    alone = [HeadDrafter(net, min_prob=c) for c in cut]
    assert net.half_weights
    seen = [0] * len(prompts)  # entries each drafter has
    length = [len(p) + 1 for p in prompts]
    for d1, d2, p in zip(together, alone, prompts, strict=True):
        d1.begin(p)
        d2.begin(p)
    nodes = 0
    for step in range(5):
        ctxs = []
        for j, p in enumerate(prompts):
            length[j] += (step * (j + 1)) % 4  # 0..3 new entries a step, varied
            n = length[j]
            toks = [*p, *full[j]][:n]
            hidden = engine.hidden_states(toks[:-1], TAPS)
            ctxs.append(DraftContext(toks, len(p), spec, tuple(h[seen[j] :] for h in hidden)))
            seen[j] = n - 1
        got = propose_all(together, ctxs)
        want = [d.propose(c) for d, c in zip(alone, ctxs, strict=True)]
        for g, w in zip(got, want, strict=True):
            assert g.tokens.tolist() == w.tokens.tolist()
            assert g.parents.tolist() == w.parents.tolist()
            assert torch.equal(g.scores, w.scores)
            nodes += g.size
    assert nodes > 20
    assert [d.forwards for d in together] == [d.forwards for d in alone]
