"""Trained drafters on tiny targets: masks, valid trees, losslessness, save/load, guards."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from specpilot.drafters import make_drafter
from specpilot.drafters.base import DraftContext
from specpilot.drafters.block import BlockDrafter, best_first_tree, block_mask, block_train_logits
from specpilot.drafters.feature_net import FeatureNet, FeatureNetConfig
from specpilot.drafters.head import HeadDrafter, head_unroll, ttt_mask
from specpilot.drafters.trained import (
    load_trained_drafter,
    read_drafter_dir,
    save_drafter,
    write_dir_atomic,
)
from specpilot.engine import Engine, GenerationConfig
from specpilot.errors import DrafterError
from specpilot.model import Transformer, causal_mask
from specpilot.tree import DraftTree, TreeSpec

from .conftest import tiny_model

SPECS = [
    TreeSpec(kind="chain", k=4),
    TreeSpec(kind="static", paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
    TreeSpec(kind="dynamic", budget=12, topk=3, depth=5),
]
TAPS = (1, 2)


def make_net(kind: str, target: Transformer, seed: int = 0, draft_vocab: int = 40) -> FeatureNet:
    c = target.cfg
    cfg = FeatureNetConfig(
        kind=kind,
        dim=c.dim,
        vocab_size=c.vocab_size,
        taps=TAPS,
        n_layers=1 if kind == "head" else 2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=12,
        intermediate_size=64,
        block=4 if kind == "block" else 0,
        draft_vocab=draft_vocab,
        extra={"target_fingerprint": "f" * 64},
    )
    net = FeatureNet(cfg)
    net.init_weights(seed, std=0.3)
    g = torch.Generator().manual_seed(seed)
    net.vocab_ids.copy_(torch.randperm(c.vocab_size, generator=g)[:draft_vocab].sort().values)
    net.attach(target.model.embed_tokens.weight, target.head_weight())
    return net


def target_states(model: Transformer, toks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    t = toks.shape[1]
    model.setup_cache(64)
    out = model(toks, torch.arange(t)[None], 0, t, causal_mask(0, t, t, "cpu"), hidden_layers=TAPS)
    return out.hidden


def test_masks() -> None:
    m = ttt_mask(5, 2)
    assert m.shape == (3, 5 + 2 * 3)
    assert m[1, :5].tolist() == [True, True, False, False, False]  # step-0 entries 0..j
    assert m[1, 5:].tolist() == [False, True, False] * 2  # its own chain only
    b = block_mask(torch.tensor([1, 3]), 5, 3)
    assert b.shape == (6, 11)
    assert b[:3, :5].tolist() == [[True, True, False, False, False]] * 3
    assert b[:3, 5:8].all() and not b[:3, 8:].any()  # non-causal within a block, no other block


def test_head_inference_matches_training_unroll() -> None:
    """Chain scores of the drafter (cache + scratch rows) = the unrolled training forward."""
    target = tiny_model(seed=1)
    net = make_net("head", target)
    toks = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(0))
    hid = target_states(target, toks)
    d = HeadDrafter(net)
    n = 7
    d.begin(toks[0, :3].tolist())
    spec = TreeSpec(kind="chain", k=3)
    d._feed_committed(DraftContext(toks[0, :4].tolist(), 3, spec, tuple(h[0, :3] for h in hid)), 8)
    ctx = DraftContext(toks[0, :n].tolist(), 3, spec, tuple(h[0, 3 : n - 1] for h in hid))
    tree = d.propose(ctx)
    assert tree.size == 3
    seq = torch.cat([toks[:, :n], tree.tokens[None]], 1)
    taps = torch.stack(hid, dim=2)[:, :n]
    taps = torch.cat([taps, torch.zeros(1, 3, *taps.shape[2:])], 1)
    with torch.no_grad():
        outs = head_unroll(net, taps, seq, 3)
    score = 0.0
    for s in range(3):
        logits, pos = outs[s]
        assert pos[n - 2] == n - 1 + s
        lp = torch.log_softmax(logits[0, n - 2], -1)
        score += float(lp[(net.vocab_ids == tree.tokens[s]).nonzero()[0, 0]])
        assert abs(score - float(tree.scores[s])) < 1e-4


def test_block_inference_matches_training() -> None:
    target = tiny_model(seed=1)
    net = make_net("block", target)
    toks = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    hid = target_states(target, toks)
    d = BlockDrafter(net)
    d.begin([])
    n = 9
    ctx = DraftContext(toks[0].tolist(), 2, TreeSpec(), tuple(h[0, : n - 1] for h in hid))
    lp = d.block_log_probs(ctx)  # (B, V)
    assert lp.shape == (4, 40)
    with torch.no_grad():
        rows = block_train_logits(net, torch.stack(hid, dim=2), toks, anchors=8)
    for i, (logits, pos) in enumerate(rows):
        a = int((pos == n - 2 + i + 1).nonzero()[0, 0])  # the block after anchor n-2
        assert torch.allclose(torch.log_softmax(logits[0, a], -1), lp[i], atol=1e-4)


@pytest.mark.parametrize("kind", ["head", "block"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_trees_valid_and_lossless(kind: str, spec: TreeSpec) -> None:
    """Trees within budget and depth; speculative output equals plain greedy output."""
    target = tiny_model(seed=3)
    engine = Engine(target)
    net = make_net(kind, target, seed=4)
    drafter = (HeadDrafter if kind == "head" else BlockDrafter)(net)
    seen: list[DraftTree] = []
    propose = drafter.propose

    def spy(ctx: DraftContext) -> DraftTree:
        t = propose(ctx)
        seen.append(t)
        return t

    drafter.propose = spy  # type: ignore[method-assign]
    gen = GenerationConfig(max_new_tokens=24)
    for prompt in ([1, 2, 3, 4, 5], [7, 7, 7, 9]):
        ref = engine.generate(prompt, gen).tokens
        res = engine.generate(prompt, gen, drafter=drafter, spec=spec)
        assert res.tokens == ref
    assert seen and any(t.size for t in seen)
    for t in seen:
        assert t.size <= spec.max_nodes
        assert t.size == 0 or int(t.depths.max()) <= spec.max_depth
        assert all(p < i for i, p in enumerate(t.parents.tolist()))
        assert set(t.tokens.tolist()) <= set(net.vocab_ids.tolist())


def test_best_first_tree_budget_order() -> None:
    lp = torch.log_softmax(torch.randn(6, 20, generator=torch.Generator().manual_seed(0)), -1)
    t = best_first_tree(lp, TreeSpec(kind="dynamic", budget=10, topk=3, depth=4))
    assert t.size == 10 and int(t.depths.max()) <= 4
    sc = t.scores.tolist()
    assert sc == sorted(sc, reverse=True)  # popped best-first
    chain = best_first_tree(lp, TreeSpec(kind="chain", k=5))
    assert chain.tokens.tolist() == lp[:5].argmax(-1).tolist()


def test_save_load_round_trip(tmp_path: Path) -> None:
    target = tiny_model(seed=1)
    net = make_net("head", target)
    out = save_drafter(net, tmp_path / "d", {"command": "test"}, dtype=torch.float32)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "training_record.json",
    ]
    _, state = read_drafter_dir(out)
    assert not any("embed" in k or k == "head" for k in state)  # target weights never stored
    d = load_trained_drafter(out, target, fingerprint="f" * 64)
    for k, v in net.state_dict().items():
        assert torch.equal(d.net.state_dict()[k], v), k
    d2 = make_drafter(str(out), target=target)
    assert isinstance(d2, HeadDrafter)
    u = make_drafter(f"{out}+suffix", target=target, trust=2, trained_depth=3, min_prob=0.25)
    assert (u.trust, u.trained_depth) == (2, 3)
    assert u.trained.min_logp == pytest.approx(math.log(0.25))
    with pytest.raises(DrafterError, match="X\\+suffix"):
        make_drafter(str(out), target=target, trust=2)


def _saved(tmp_path: Path) -> tuple[Path, Transformer]:
    target = tiny_model(seed=1)
    return save_drafter(make_net("head", target), tmp_path / "d", {}), target


def test_guard_hidden_size_vocab_fingerprint(tmp_path: Path) -> None:
    out, target = _saved(tmp_path)
    with pytest.raises(DrafterError, match="another target"):
        load_trained_drafter(out, target, fingerprint="0" * 64)
    other = tiny_model(seed=1, dim=32, n_heads=4)
    with pytest.raises(DrafterError, match="hidden size"):
        load_trained_drafter(out, other)
    with pytest.raises(DrafterError, match="vocabulary"):
        load_trained_drafter(out, tiny_model(seed=1, vocab=80))


def test_guard_corrupt_dir(tmp_path: Path) -> None:
    out, target = _saved(tmp_path)
    w = out / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(DrafterError, match="corrupt"):
        load_trained_drafter(out, target)
    (out / "config.json").write_text("{not json")
    with pytest.raises(DrafterError, match="corrupt"):
        load_trained_drafter(out, target)
    (out / "config.json").unlink()
    with pytest.raises(DrafterError, match="missing"):
        load_trained_drafter(out, target)
    cfg = json.loads(json.dumps(make_net("head", target).cfg.to_json()))
    cfg["n_layers"] = 3
    out2, _ = _saved(tmp_path / "b")
    (out2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterError, match="do not match"):
        load_trained_drafter(out2, target)


def test_write_dir_atomic_keeps_old_on_failure(tmp_path: Path) -> None:
    final = tmp_path / "d"
    write_dir_atomic(final, lambda p: (p / "a").write_text("old"))

    def broken(p: Path) -> None:
        (p / "a").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_dir_atomic(final, broken)
    assert (final / "a").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_engine_hidden_states_required() -> None:
    target = tiny_model(seed=1)
    d = HeadDrafter(make_net("head", target))
    d.begin([1, 2])
    with pytest.raises(DrafterError, match="hidden states"):
        d.propose(DraftContext([1, 2, 3], 2, TreeSpec()))


@pytest.mark.parametrize("spec", SPECS[::2], ids=lambda s: s.kind)
def test_union_with_suffix_lossless_within_budget(spec: TreeSpec) -> None:
    from specpilot.drafters.suffix import SuffixDrafter
    from specpilot.drafters.union import UnionDrafter, union_trees

    target = tiny_model(seed=3)
    engine = Engine(target)
    drafter = UnionDrafter(SuffixDrafter(), HeadDrafter(make_net("head", target, seed=4)))
    assert drafter.hidden_layers == TAPS
    gen = GenerationConfig(max_new_tokens=30)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    ref = engine.generate(prompt, gen).tokens
    res = engine.generate(prompt, gen, drafter=drafter, spec=spec)
    assert res.tokens == ref
    assert max(res.draft_nodes) <= spec.max_nodes
    a = DraftTree.from_parents([1, 2, 3], [-1, 0, 1])
    b = DraftTree.from_parents([1, 9, 2, 8], [-1, -1, 0, 2], [-0.1, -0.2, -0.3, -0.4])
    u = union_trees(a, b, 5)
    assert u.tokens.tolist() == [1, 2, 3, 9, 8] and u.parents.tolist() == [-1, 0, 1, -1, 1]


@pytest.mark.parametrize("spec", SPECS[::2], ids=lambda s: s.kind)
def test_union_trust_skips_the_head_and_feeds_it_the_skipped_states(spec: TreeSpec) -> None:
    from specpilot.drafters.suffix import SuffixDrafter
    from specpilot.drafters.union import UnionDrafter

    target = tiny_model(seed=3)
    engine = Engine(target)
    net = make_net("head", target, seed=4)
    head = HeadDrafter(net)
    checks: list[bool] = []
    real = head.propose

    def spy(ctx: DraftContext) -> DraftTree:  # the head fed in bursts == a head fed from scratch
        tree = real(ctx)
        fresh = HeadDrafter(net)
        full = engine.hidden_states(ctx.tokens[:-1], TAPS)
        want = fresh.propose(DraftContext(ctx.tokens, ctx.prompt_len, ctx.spec, full))
        checks.append(
            tree.tokens.tolist() == want.tokens.tolist()
            and torch.allclose(tree.scores, want.scores, atol=1e-4)
        )
        return tree

    head.propose = spy  # type: ignore[method-assign]
    drafter = UnionDrafter(SuffixDrafter(), head, trust=1)
    gen = GenerationConfig(max_new_tokens=40)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 9, 7]
    ref = engine.generate(prompt, gen).tokens
    res = engine.generate(prompt, gen, drafter=drafter, spec=spec)
    assert res.tokens == ref
    assert max(res.draft_nodes) <= spec.max_nodes
    assert drafter.copy_steps > 0 and len(checks) > 0, (drafter.copy_steps, len(checks))
    assert drafter.copy_steps + len(checks) == res.steps
    assert all(checks)
    with pytest.raises(DrafterError, match="trust"):
        UnionDrafter(SuffixDrafter(), head, trust=-1)


def test_head_min_prob_stops_expansion_and_stays_lossless() -> None:
    """Nodes below ``min_prob`` are not expanded: fewer forwards, every tree within the spec,
    output unchanged; ``min_prob`` outside [0, 1) is refused."""
    target = tiny_model(seed=3)
    engine = Engine(target)
    net = make_net("head", target, seed=4)
    gen = GenerationConfig(max_new_tokens=24)
    prompt = [3, 9, 4, 1, 7, 7, 2]
    ref = engine.generate(prompt, gen).tokens
    for spec in (SPECS[0], SPECS[2]):
        full, cut = HeadDrafter(net), HeadDrafter(net, min_prob=0.999)
        a = engine.generate(prompt, gen, drafter=full, spec=spec)
        b = engine.generate(prompt, gen, drafter=cut, spec=spec)
        assert a.tokens == b.tokens == ref
        assert cut.forwards == b.steps  # the committed-token feed only: no depth was expanded
        assert full.forwards > a.steps
        assert max(b.draft_nodes) <= (spec.topk if spec.kind == "dynamic" else 1)
    with pytest.raises(DrafterError, match="min_prob"):
        HeadDrafter(net, min_prob=1.0)


def test_shipped_head_drafter_is_complete_and_small() -> None:
    from specpilot.drafters.trained import shipped_drafters

    dirs = {p.name: p for p in shipped_drafters()}
    d = dirs["smollm2-135m-head"]
    cfg, state = read_drafter_dir(d)
    assert cfg.kind == "head" and cfg.dim == 576 and cfg.vocab_size == 49152
    assert len(cfg.extra["target_fingerprint"]) == 64
    assert sum(f.stat().st_size for f in d.iterdir()) <= 30 * 2**20
    assert state["vocab_ids"].numel() == cfg.draft_vocab
    rec = json.loads((d / "training_record.json").read_text())
    assert rec["command"].startswith("specpilot train-drafter") and rec["eval_final"]["tau"] > 1.5


def test_default_drafting_is_the_shipped_head_where_one_ships() -> None:
    from types import SimpleNamespace

    from specpilot.drafters.trained import shipped_drafters
    from specpilot.runtime import DEFAULT_TREE, HEAD_TREE, default_drafting

    fp = read_drafter_dir(shipped_drafters()[0])[0].extra["target_fingerprint"]
    assert default_drafting(SimpleNamespace(fingerprint=fp)) == ("head+suffix", HEAD_TREE)
    other = SimpleNamespace(fingerprint="0" * 64)
    assert default_drafting(other) == ("suffix", DEFAULT_TREE)


def test_packed_inference_matches_modules_and_never_goes_stale() -> None:
    """pack(): the packed linears give the module's numbers (the bf16 LM head to bf16
    precision), are bypassed under autograd, and are dropped once a training step changed the
    weights."""
    target = tiny_model(seed=1)
    net = make_net("head", target)
    taps = torch.randn(1, 5, len(TAPS), target.cfg.dim, generator=torch.Generator().manual_seed(2))
    toks = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain_x = net.entries(taps, toks)
        plain = net.logits(plain_x)
    if not net.pack():
        pytest.skip("no oneDNN linear in this torch build")
    assert net.fast and net.layers[0].fast and net.head_fn is not None
    with torch.no_grad():
        x = net.entries(taps, toks)
        assert torch.allclose(x, plain_x, atol=1e-5)
        assert torch.allclose(net.logits(x), plain, atol=5e-2, rtol=2e-2)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    net.entries(taps, toks).square().mean().backward()  # autograd: the modules themselves
    opt.step()
    with torch.no_grad():
        after = net.entries(taps, toks)
        net.fast = {}  # what a fresh pack-less forward gives with the new weights
        want = net.entries(taps, toks)
    assert not torch.allclose(after, plain_x, atol=1e-3)
    assert torch.equal(after, want)


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2]])
def test_cost_model_replay_of_a_head_reproduces_the_engine(spec: TreeSpec) -> None:
    """The replay feeds a feature drafter the target's states along the reference (one causal
    forward, ``Engine.hidden_states``): its plan-tree replay takes exactly the engine's steps."""
    from specpilot.costmodel.replay import ReplaySpecs, greedy_steps, replay_prompt

    target = tiny_model(seed=3)
    engine = Engine(target)
    net = make_net("head", target, seed=4)
    gen = GenerationConfig(max_new_tokens=24)
    specs = ReplaySpecs.for_plan(spec, 8, 4, 4)
    for prompt in ([1, 2, 3, 4, 5], [7, 7, 7, 9]):
        res = engine.generate(prompt, gen, drafter=HeadDrafter(net), spec=spec)
        hidden = engine.hidden_states([*prompt, *res.tokens], TAPS)
        assert [h.shape[0] for h in hidden] == [len(prompt) + len(res.tokens)] * len(TAPS)
        rep = replay_prompt(HeadDrafter(net), prompt, res.tokens, specs, (1, 4, 8), None, hidden)
        assert greedy_steps(rep.plan) == res.steps


def test_a_net_built_on_the_meta_device_imports_no_sympy() -> None:
    """build_net builds on the meta device; an arange there runs torch's Python reference, which
    imports sympy (~36 MB resident) into every process that loads a drafter."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from specpilot.drafters.feature_net import FeatureNet, FeatureNetConfig\n"
        "cfg = FeatureNetConfig(kind='head', dim=64, vocab_size=97, taps=(0,), n_heads=4,\n"
        "                       n_kv_heads=2, head_dim=16, intermediate_size=128, draft_vocab=40)\n"
        "with torch.device('meta'):\n"
        "    net = FeatureNet(cfg)\n"
        "assert net.vocab_ids.shape == (40,) and net.vocab_ids.dtype == torch.long\n"
        "print('sympy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    built = FeatureNet(FeatureNetConfig(kind="head", dim=64, vocab_size=97, taps=(0,), n_heads=4,
                                        n_kv_heads=2, head_dim=16, intermediate_size=128,
                                        draft_vocab=40))  # fmt: skip
    assert torch.equal(built.vocab_ids, torch.arange(40))  # off the meta device: the identity
