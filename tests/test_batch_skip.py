"""Batched decoding while drafting is skipped: the target states a drafter missed reach it in
order at its next call (nothing lost, nothing twice), the tokens stay plain decoding's, and a
trained drafter built without its random init has the saved weights bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specpilot.batch import BatchConfig, BatchEngine, BatchRequest
from specpilot.drafters.base import DraftContext
from specpilot.drafters.feature_net import FeatureNet
from specpilot.drafters.head import HeadDrafter
from specpilot.drafters.suffix import SuffixDrafter
from specpilot.drafters.trained import (
    build_net,
    load_trained_drafter,
    read_drafter_dir,
    save_drafter,
)
from specpilot.drafters.union import UnionDrafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig, join_chunks
from specpilot.goodput import CostCurve, Selector
from specpilot.tree import DraftTree, TreeSpec

from .conftest import tiny_model
from .test_trained_drafters import TAPS, make_net

GEN = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42, 3]]


class EveryFew(Selector):
    """Drafts on the steps in ``draft_on`` only and verifies every proposed node."""

    def __init__(self, draft_on: set[int]) -> None:
        super().__init__(CostCurve([1], [1.0]))
        self.draft_on, self.k = draft_on, 0

    def should_draft(self, batch: int = 1) -> bool:
        self.k += 1
        return self.k in self.draft_on

    def select(self, trees: Any, *args: Any, **kwargs: Any) -> list[DraftTree]:
        return list(trees)


class Spy:
    """A head drafter that records what each call handed it."""

    def __init__(self, head: HeadDrafter) -> None:
        self.head, self.name, self.hidden_layers = head, "spy", head.hidden_layers
        self.calls: list[tuple[int, tuple[torch.Tensor, ...]]] = []

    def begin(self, prompt: list[int]) -> None:
        self.head.begin(prompt)

    def propose(self, ctx: DraftContext) -> DraftTree:
        self.calls.append((len(ctx.tokens), ctx.hidden))
        return self.head.propose(ctx)

    def finish(self, tokens: list[int]) -> None:
        self.head.finish(tokens)


def test_skipped_steps_hand_every_state_over_once_and_stay_lossless() -> None:
    target = tiny_model("llama", seed=3, std=0.12)
    alone = Engine(tiny_model("llama", seed=3, std=0.12), EngineConfig())  # the same weights
    refs = [alone.generate(p, GEN).tokens for p in PROMPTS]
    beng = BatchEngine(target, EngineConfig(goodput=True), BatchConfig(max_batch=3, max_len=128))
    beng.selector = EveryFew({3, 4, 9, 15})  # skips the first two steps and gaps of 4 and 5
    spies = [Spy(HeadDrafter(make_net("head", target))) for _ in PROMPTS]
    spec = TreeSpec(kind="chain", k=3)
    slots = [beng.add(BatchRequest(list(p), GEN, drafter=d, spec=spec))
             for p, d in zip(PROMPTS, spies, strict=True)]
    while beng.slots:
        beng.step()
    assert [s.res.tokens for s in slots] == refs
    for p, ref, spy in zip(PROMPTS, refs, spies, strict=True):
        assert len(spy.calls) == 4
        states = alone.hidden_states([*p, *ref], TAPS)
        seen = 0
        for n, hidden in spy.calls:  # states of entries seen..n-2, in order
            assert len(hidden) == len(TAPS)
            for h, want in zip(hidden, states, strict=True):
                assert h.shape[0] == n - 1 - seen
                torch.testing.assert_close(h, want[seen : n - 1], atol=1e-5, rtol=1e-5)
            seen = n - 1


def test_a_union_drafting_its_copy_part_alone_hands_every_state_to_the_head_once() -> None:
    """The goodput budget's cheap tier: on the steps the full drafter sits out, a union's copy
    drafter drafts alone (its trees are verified), and the head still receives the states of
    every committed token, once and in order, at its next draft; the tokens stay plain's."""
    target = tiny_model("llama", seed=3, std=0.12)
    alone = Engine(tiny_model("llama", seed=3, std=0.12), EngineConfig())
    refs = [alone.generate(p, GEN).tokens for p in PROMPTS]
    beng = BatchEngine(target, EngineConfig(goodput=True), BatchConfig(max_batch=3, max_len=128))
    beng.selector = EveryFew({1, 5, 6, 12})
    spies = [Spy(HeadDrafter(make_net("head", target))) for _ in PROMPTS]
    unions = [UnionDrafter(SuffixDrafter(), spy) for spy in spies]
    spec = TreeSpec(kind="chain", k=3)
    slots = [beng.add(BatchRequest(list(p), GEN, drafter=d, spec=spec))
             for p, d in zip(PROMPTS, unions, strict=True)]  # fmt: skip
    cheap_nodes = 0
    while beng.slots:
        k = beng.selector.k
        _, stats = beng.step()
        if beng.selector.k - k == 1 and beng.selector.k not in beng.selector.draft_on:
            cheap_nodes += stats.nodes
    assert [s.res.tokens for s in slots] == refs
    assert cheap_nodes > 0  # the copy parts' trees were verified on the head's skipped steps
    for p, ref, spy in zip(PROMPTS, refs, spies, strict=True):
        assert len(spy.calls) == 4
        states = alone.hidden_states([*p, *ref], TAPS)
        seen = 0
        for n, hidden in spy.calls:
            for h, want in zip(hidden, states, strict=True):
                assert h.shape[0] == n - 1 - seen
                torch.testing.assert_close(h, want[seen : n - 1], atol=1e-5, rtol=1e-5)
            seen = n - 1


def test_joined_concatenates_chunks_per_layer() -> None:
    a = (torch.zeros(2, 3), torch.ones(2, 3))
    b = (torch.full((1, 3), 2.0), torch.full((1, 3), 3.0))
    assert join_chunks([]) == ()
    assert join_chunks([a])[0] is a[0]
    j = join_chunks([a, b])
    assert [t.shape[0] for t in j] == [3, 3]
    assert j[0][2, 0] == 2.0 and j[1][0, 0] == 1.0


def test_meta_built_drafter_has_the_saved_weights_and_drafts_the_same(tmp_path: Path) -> None:
    target = tiny_model("llama", seed=3, std=0.12)
    out = save_drafter(make_net("head", target), tmp_path / "d", {}, dtype=torch.float32)
    cfg, state = read_drafter_dir(out)
    old = FeatureNet(cfg)  # the old way: random init, then the load copies over it
    old.load_state_dict(state)
    new = build_net(cfg, read_drafter_dir(out)[1], str(out))
    assert [k for k, _ in old.named_parameters()] == [k for k, _ in new.named_parameters()]
    for (k, a), b in zip(old.state_dict().items(), new.state_dict().values(), strict=True):
        assert b.device.type == "cpu" and a.dtype == b.dtype, k
        assert torch.equal(a, b), k
    old.attach(target.model.embed_tokens.weight, target.head_weight())
    d_old = HeadDrafter(old)
    d_new = load_trained_drafter(out, target, fingerprint="f" * 64)
    prompt = PROMPTS[0]
    states = Engine(target, EngineConfig()).hidden_states(prompt, TAPS)
    spec = TreeSpec(kind="dynamic", budget=8, topk=2, depth=3)
    trees = []
    for d in (d_old, d_new):
        d.begin(prompt[:-1])
        trees.append(d.propose(DraftContext(prompt, len(prompt) - 1, spec,
                                            tuple(h[:-1] for h in states))))
    assert trees[0].size > 0
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
    assert trees[0].parents.tolist() == trees[1].parents.tolist()
    assert torch.equal(trees[0].scores, trees[1].scores)


def test_drafters_of_one_directory_share_the_net_and_keep_their_own_cache(tmp_path: Path) -> None:
    """A drafter per request reuses the loaded net (read, attached and packed once); each keeps
    its own per-sequence cache, so two interleaved sequences draft what each drafts alone; a
    rewritten directory is read again."""
    target = tiny_model("llama", seed=3, std=0.12)
    out = save_drafter(make_net("head", target), tmp_path / "d", {}, dtype=torch.float32)
    a = load_trained_drafter(out, target, fingerprint="f" * 64)
    b = load_trained_drafter(out, target, fingerprint="f" * 64)
    assert a.net is b.net and a._k is not b._k
    spec = TreeSpec(kind="dynamic", budget=8, topk=2, depth=3)

    def draft(d: HeadDrafter, prompt: list[int]) -> list[int]:
        states = Engine(target, EngineConfig()).hidden_states(prompt, TAPS)
        d.begin(prompt[:-1])
        ctx = DraftContext(prompt, len(prompt) - 1, spec, tuple(h[:-1] for h in states))
        return d.propose(ctx).tokens.tolist()

    p, q = PROMPTS[0], PROMPTS[1]
    both = (draft(a, p), draft(b, q), draft(a, p))  # interleaved on the shared net
    alone = [draft(load_trained_drafter(out, target, fingerprint="f" * 64), x) for x in (p, q)]
    assert both == (alone[0], alone[1], alone[0]) and both[0]
    save_drafter(make_net("head", target, seed=9), out, {}, dtype=torch.float32)  # retrained
    c = load_trained_drafter(out, target, fingerprint="f" * 64)
    assert c.net is not a.net
