"""Exact replay: accepted lengths, the step simulation and the oracle DP, and the two promises -
tau_opt(N) bounds every tree shape the engine runs at budget N, and tau_bf(N) equals the engine's
dynamic-tree tau for a deterministic drafter."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from specpilot.costmodel.replay import (
    ReplaySpecs,
    TauCurves,
    accepted_length,
    budget_grid,
    greedy_steps,
    longest_match,
    min_steps,
    replay_prompt,
    tau_curves,
)
from specpilot.drafters import make_drafter
from specpilot.drafters.base import DraftContext, Drafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig, GenerationResult
from specpilot.tree import DraftTree, TreeSpec, shape_tree, subtree

from .conftest import tiny_model

VOCAB = 64


class TrieOracle:
    """Deterministic drafter: at each position a fixed candidate trie (beam 3, 3 children per
    expanded node, depth 10) drawn from a seed and the position; the reference token sits at a
    random rank with probability ``hit``. Every spec is cut from the same trie, so the tree a
    spec gets depends only on the committed tokens (what exact replay needs)."""

    name = "trie-oracle"
    hidden_layers: tuple[int, ...] = ()
    BEAM, WIDTH, DEPTH = 3, 3, 10

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], hit: float, seed: int) -> None:
        self.outputs, self.hit, self.seed = outputs, hit, seed
        self.prompt: tuple[int, ...] = ()

    def begin(self, prompt: list[int]) -> None:
        self.prompt = tuple(prompt)

    def finish(self, tokens: list[int]) -> None:
        pass

    def trie(self, tokens: Sequence[int]) -> tuple[DraftTree, list[int]]:
        """The full candidate trie at ``tokens`` and each node's sibling rank."""
        ref = self.outputs[self.prompt]
        done = len(tokens) - len(self.prompt)
        rng = random.Random(hash((self.seed, self.prompt, done)))
        toks, parents, scores, ranks = [], [], [], []
        frontier = [(-1, True, 0.0)]
        for d in range(self.DEPTH):
            nxt = []
            for node, on_path, sc in frontier:
                want = ref[done + d] if done + d < len(ref) else -1
                hit = on_path and want >= 0 and rng.random() < self.hit
                true_rank = rng.randrange(self.WIDTH) if hit else -1
                for r in range(self.WIDTH):
                    tok = want if r == true_rank else rng.randrange(VOCAB)
                    if r != true_rank and tok == want:
                        tok = (tok + 1) % VOCAB
                    toks.append(tok)
                    parents.append(node)
                    scores.append(sc - 0.3 * (r + 1) - 0.01 * rng.random())
                    ranks.append(r)
                    nxt.append((len(toks) - 1, r == true_rank, scores[-1]))
            frontier = sorted(nxt, key=lambda x: -x[2])[: self.BEAM]
        return DraftTree.from_parents(toks, parents, scores), ranks

    def propose(self, ctx: DraftContext) -> DraftTree:
        spec = ctx.spec
        cand, ranks = self.trie(ctx.tokens)
        keep = [
            i
            for i in range(cand.size)
            if int(cand.depths[i]) <= spec.max_depth and ranks[i] < spec.branching
        ]
        closed = [i for i in keep if _ancestors_in(cand, i, set(keep))]
        return shape_tree(subtree(cand, closed), spec)


def _ancestors_in(tree: DraftTree, i: int, keep: set[int]) -> bool:
    p = int(tree.parents[i])
    while p >= 0:
        if p not in keep:
            return False
        p = int(tree.parents[p])
    return True


# -- pure functions ----------------------------------------------------------------------------


def test_accepted_and_longest() -> None:
    t = DraftTree.from_parents([5, 6, 7, 5, 8], [-1, -1, 0, -1, 3])  # 5->7, 6, 5(dup)->8
    assert accepted_length(t, [5, 7, 1]) == 2
    assert accepted_length(t, [5, 8]) == 1  # the engine follows the first matching child
    assert longest_match(t, [5, 8]) == 2  # the oracle may use the duplicate
    assert accepted_length(t, [9]) == 0 and longest_match(t, [9]) == 0
    assert accepted_length(t, []) == 0 and longest_match(DraftTree.empty(), [1]) == 0
    assert accepted_length(t, [5]) == 1  # matching all of the known output stops there


def test_step_simulation() -> None:
    assert greedy_steps([]) == 0
    assert greedy_steps([0, 0, 0]) == 3
    assert greedy_steps([3, 0, 0, 1]) == 1
    # greedy accepts 1 at c=1 and jumps past the long match at c=2: 1 -> 3 -> 4 -> 5
    assert greedy_steps([1, 3, 0, 0]) == 3
    assert min_steps([1, 3, 0, 0], 8) == 2  # the oracle accepts 0 at c=1: 1 -> 2 -> 6
    assert min_steps([1, 3, 0, 0], 1) == 3


@pytest.mark.parametrize("seed", range(20))
def test_min_steps_is_the_exhaustive_optimum(seed: int) -> None:
    rng = random.Random(seed)
    t = rng.randrange(2, 9)
    longest = [rng.randrange(0, t - c + 1) for c in range(1, t)]
    budget = rng.randrange(1, 5)

    def brute(c: int) -> int:
        if c >= t:
            return 0
        a = min(budget, longest[c - 1])
        return 1 + min(brute(c + j + 1) for j in range(a + 1))

    assert min_steps(longest, budget) == brute(1)
    assert min_steps(longest, budget) <= greedy_steps([min(budget, x) for x in longest])


def test_grid_and_specs() -> None:
    assert budget_grid(16) == (1, 2, 4, 8, 12, 16)
    assert budget_grid(16, 5) == (1, 2, 4, 5, 8, 12, 16)
    specs = ReplaySpecs.for_plan(TreeSpec(kind="chain", k=6), 32, 20, 8)
    assert specs.best_first == TreeSpec(kind="dynamic", budget=32, topk=4, depth=8)
    assert specs.plan == TreeSpec(kind="chain", k=6) and specs.plan in specs.union
    assert TreeSpec(kind="chain", k=20) in specs.union
    plan = TreeSpec(kind="dynamic", budget=12, topk=3, depth=5)
    specs = ReplaySpecs.for_plan(plan, 16, 12, 6)
    assert specs.best_first == TreeSpec(kind="dynamic", budget=16, topk=3, depth=5)
    assert plan in specs.union


def test_tau_curves_ar_and_toy() -> None:
    assert tau_curves([], (0,)).tau_opt == (1.0,)


# -- against the engine ------------------------------------------------------------------------


def _pooled_tau(runs: list[GenerationResult]) -> float:
    """Output tokens committed by decode steps / steps (the replay's definition)."""
    return sum(len(r.tokens) - 1 for r in runs) / sum(r.steps for r in runs)


def _engine_runs(
    eng: Engine, prompts: list[list[int]], drafter: Drafter, spec: TreeSpec, gen: GenerationConfig
) -> list[GenerationResult]:
    return [eng.generate(p, gen, drafter=drafter, spec=spec) for p in prompts]


def _replay(
    prompts: list[list[int]],
    refs: list[GenerationResult],
    drafter: Drafter,
    plan: TreeSpec,
    grid: tuple[int, ...],
) -> TauCurves:
    """Replay with a candidate set wide enough (128 nodes) to hold every test shape."""
    specs = ReplaySpecs.for_plan(plan, 128, replay_depth=12, wide_topk=8)
    reps = [
        replay_prompt(drafter, p, r.tokens, specs, grid) for p, r in zip(prompts, refs, strict=True)
    ]
    return tau_curves(reps, grid)


STATIC = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1))


@pytest.mark.parametrize("seed", range(4))
def test_tau_opt_bounds_every_shape_and_tau_bf_is_exact(seed: int) -> None:
    model = tiny_model("llama", seed=seed)
    eng = Engine(model, EngineConfig(attention="exact"))
    gen = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 9))] for _ in range(3)]
    refs = [eng.generate(p, gen) for p in prompts]
    outputs = {tuple(p): r.tokens for p, r in zip(prompts, refs, strict=True)}
    hit = (0.5, 0.7, 0.9, 1.0)[seed]
    topk, depth = 3, 6
    plan = TreeSpec(kind="dynamic", budget=16, topk=topk, depth=depth)
    grid = (0, 1, 2, 4, 8, 12, 16, 24)
    curves = _replay(prompts, refs, TrieOracle(outputs, hit, seed), plan, grid)
    opt = dict(zip(curves.grid, curves.tau_opt, strict=True))
    bf = dict(zip(curves.grid, curves.tau_bf, strict=True))
    assert all(b <= o + 1e-12 for b, o in zip(curves.tau_bf, curves.tau_opt, strict=True))
    assert curves.tau_plan == pytest.approx(bf[16], abs=1e-12)  # the plan is the best-first 16
    assert list(curves.tau_opt) == sorted(curves.tau_opt)  # more nodes never hurt the oracle
    for n in (1, 2, 4, 8, 12, 16):
        shapes = [
            TreeSpec(kind="chain", k=n),
            TreeSpec(kind="dynamic", budget=n, topk=topk, depth=depth),
            TreeSpec(kind="dynamic", budget=n, topk=2, depth=10),
        ]
        if n == len(STATIC):
            shapes.append(TreeSpec(kind="static", paths=STATIC))
        for spec in shapes:
            runs = _engine_runs(eng, prompts, TrieOracle(outputs, hit, seed), spec, gen)
            assert [r.tokens for r in runs] == [r.tokens for r in refs]
            tau = _pooled_tau(runs)
            assert opt[n] >= tau - 1e-12, (n, spec, opt[n], tau)
            if spec.kind == "dynamic" and spec.topk == topk:
                assert bf[n] == pytest.approx(tau, abs=1e-12), (n, bf[n], tau)


@pytest.mark.parametrize("drafter", ["lookup", "suffix"])
@pytest.mark.parametrize("kind", ["chain", "static", "dynamic"])
def test_real_drafters_bounded_by_replay(drafter: str, kind: str) -> None:
    """With the plan in the candidate set, tau_opt(N) >= the plan's measured tau; for lookup
    (no score ties) tau_bf(N) of a dynamic plan is exactly the engine's tau."""
    model = tiny_model("llama", seed=7)
    eng = Engine(model, EngineConfig(attention="exact"))
    gen = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    prompts = [[3, 4, 5, 6] * 4, [9, 8, 7, 9, 8, 7, 9, 8], [1, 2, 1, 2, 1, 2, 3]]
    refs = [eng.generate(p, gen) for p in prompts]
    plan = {
        "chain": TreeSpec(kind="chain", k=6),
        "static": TreeSpec(kind="static", paths=STATIC),
        "dynamic": TreeSpec(kind="dynamic", budget=12, topk=3, depth=6),
    }[kind]
    runs = _engine_runs(eng, prompts, make_drafter(drafter), plan, gen)
    assert [r.tokens for r in runs] == [r.tokens for r in refs]
    n = plan.max_nodes
    grid = (0, *budget_grid(16, n))
    curves = _replay(prompts, refs, make_drafter(drafter), plan, grid)
    opt = dict(zip(curves.grid, curves.tau_opt, strict=True))
    bf = dict(zip(curves.grid, curves.tau_bf, strict=True))
    tau = _pooled_tau(runs)
    assert tau > 1.0  # the drafter does accept something on these prompts
    assert curves.tau_plan == pytest.approx(tau, abs=1e-12)  # the replay is the engine
    assert opt[n] >= tau - 1e-12
    if kind == "dynamic":
        assert bf[n] == pytest.approx(tau, abs=1e-12) if drafter == "lookup" else bf[n] <= opt[n]


def test_trie_oracle_is_deterministic() -> None:
    d = TrieOracle({(1, 2): list(range(30))}, 0.8, 3)
    d.begin([1, 2])
    spec = TreeSpec(kind="dynamic", budget=10, topk=3, depth=4)
    a = d.propose(DraftContext([1, 2, 0], 2, spec))
    b = d.propose(DraftContext([1, 2, 0], 2, spec))
    assert a.tokens.tolist() == b.tokens.tolist() and a.size == 10
    chain = d.propose(DraftContext([1, 2, 0], 2, TreeSpec(kind="chain", k=4)))
    longer = d.propose(DraftContext([1, 2, 0], 2, TreeSpec(kind="chain", k=7)))
    assert longer.tokens.tolist()[:4] == chain.tokens.tolist()
    assert chain.depths.tolist() == [1, 2, 3, 4]
