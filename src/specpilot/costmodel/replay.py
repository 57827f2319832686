"""Exact replay: tokens per step any tree of N draft nodes would reach, without the target.

The target's greedy output ``out`` (T tokens, ``out[0]`` from prefill) is known from the reference
run. A decode step that starts with c output tokens committed verifies a tree under the root
``out[c-1]``; a node at depth d is accepted iff its path spells ``out[c:c+d]``. So, given the tree
a drafter proposes at every position c (the drafter is teacher-forced along prompt + out, fed in
order, exactly as the engine feeds it), the accepted length at c needs no target forward.

At every position the drafter is asked once per *replay spec* (budget N_max):

* the **best-first spec** - a dynamic tree with the plan's topk and depth; for each N on the grid
  ``select_best(candidates, N)`` is the best-first tree (nodes ordered by cumulative draft
  log-probability, EAGLE-2 / DDTree), verified with :func:`~specpilot.tree.verify_greedy`;
* the **plan** itself, a **wide** dynamic tree (more children per node, deeper) and a **chain** of
  the replay depth; their union with the best-first candidates is the *candidate set*. The plan's
  own trees, replayed, must give exactly the engine's tau for a deterministic drafter: a check
  of the replay itself (``tau_plan``).

Two curves over the node budget N (tau = output tokens committed by decode steps / steps, so it
counts only tokens that end in the output; ``GenerationResult.tau`` also counts draft tokens
accepted past the length limit on the last step):

* ``tau_bf(N)``: decoding simulated step by step (a step at c commits accepted + 1 tokens) with
  the best-first tree. For a deterministic drafter whose budget-N tree is the best N of its
  budget-N_max tree (lookup; not suffix, which picks its source trie by the cut tree's mass) and
  a dynamic plan with the same topk / depth, this equals the engine's tau at budget N.
* ``tau_opt(N)``: the oracle. At c, let L(c) be the longest reference-matching path among all
  candidate trees; a tree of at most N candidate nodes accepts at most min(N, L(c)), and any
  j <= min(N, L(c)) is reachable (keep just that path). The fewest steps to emit the output,
  ``S(c) = 1 + min over j of S(c + j + 1)``, is a dynamic program; ``tau_opt(N)`` is
  tokens / S(1). It bounds every policy that verifies at most N candidate nodes per step, so it
  is >= the engine's tau for the plan at N (and >= ``tau_bf(N)``) by construction, provided the
  drafter's tree depends only on the committed tokens (all drafters here do).

Example: out = [a, b, c, d, e] (T = 5), L = [3, 0, 0, 1] at c = 1..4, N = 2: from c = 1 accept 2
(b, c) + bonus d -> c = 4; accept 0 + bonus e -> done: 2 steps, tau_opt(2) = 4 / 2 = 2.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from specpilot.drafters.base import DraftContext, Drafter
from specpilot.tree import DraftTree, TreeSpec, select_best, verify_greedy

BUDGET_GRID = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def budget_grid(max_budget: int, plan_nodes: int = 0) -> tuple[int, ...]:
    """The node budgets to evaluate: :data:`BUDGET_GRID` up to ``max_budget``, plus the plan's."""
    grid = {n for n in BUDGET_GRID if n <= max_budget}
    if plan_nodes > 0:
        grid.add(plan_nodes)
    return tuple(sorted(grid))


def accepted_length(tree: DraftTree, cont: Sequence[int]) -> int:
    """Nodes greedy verification accepts when the target's output continues with ``cont``.

    Uses the engine's own :func:`verify_greedy` (first matching child wins); rows off the
    accepted path are never read, and a path that matches all of ``cont`` stops there.

    >>> t = DraftTree.from_parents([5, 6, 7], [-1, -1, 0])   # root -> 5 -> 7, root -> 6
    >>> accepted_length(t, [5, 7, 9]), accepted_length(t, [6, 1]), accepted_length(t, [5])
    (2, 1, 1)
    """
    if not cont:
        return 0
    depths = tree.depths.tolist()
    target = [cont[0]] + [cont[d] if d < len(cont) else -1 for d in depths]
    return len(verify_greedy(tree, target).path)


def longest_match(tree: DraftTree, cont: Sequence[int]) -> int:
    """Longest root path whose tokens spell a prefix of ``cont`` (any sibling, not only the
    first match).

    >>> t = DraftTree.from_parents([5, 5, 7], [-1, -1, 1])   # two 5s; only the second has a 7
    >>> longest_match(t, [5, 7]), accepted_length(t, [5, 7])
    (2, 1)
    """
    if not cont or tree.size == 0:
        return 0
    toks = tree.tokens.tolist()
    depths = tree.depths.tolist()
    parents = tree.parents.tolist()
    ok = [False] * tree.size  # node on a matching path (nodes are topologically ordered)
    best = 0
    for i in range(tree.size):
        d = depths[i]
        if d <= len(cont) and toks[i] == cont[d - 1] and (parents[i] < 0 or ok[parents[i]]):
            ok[i] = True
            best = max(best, d)
    return best


def greedy_steps(accepted: Sequence[int]) -> int:
    """Steps to emit the output when a step at c commits ``accepted[c - 1] + 1`` tokens.

    ``accepted`` has one entry per position c = 1 .. T-1 (each at most T - c).

    >>> greedy_steps([3, 0, 0, 1])   # c=1 -> 5: one step
    1
    >>> greedy_steps([0, 0, 0, 0])
    4
    """
    t = len(accepted) + 1
    c, steps = 1, 0
    while c < t:
        steps += 1
        c += accepted[c - 1] + 1
    return steps


def min_steps(longest: Sequence[int], budget: int) -> int:
    """Fewest steps when a step at c may commit any 1 .. min(budget, longest[c - 1]) + 1 tokens.

    >>> min_steps([3, 0, 0, 1], 2), min_steps([3, 0, 0, 1], 3), min_steps([0, 0, 0, 0], 8)
    (2, 1, 4)
    """
    t = len(longest) + 1
    best = [0] * (t + budget + 2)  # best[c] = 0 for c >= t
    for c in range(t - 1, 0, -1):
        a = min(budget, longest[c - 1])
        best[c] = 1 + min(best[c + 1 : c + a + 2])
    return best[1]


@dataclass(frozen=True)
class ReplaySpecs:
    """The specs a drafter is asked at every position (see the module docstring)."""

    best_first: TreeSpec
    plan: TreeSpec
    """The plan itself: replaying its own trees must give the engine's tau (a self-check)."""
    union: tuple[TreeSpec, ...]
    """Every spec whose tree joins the candidate set (best-first and plan included)."""

    @staticmethod
    def for_plan(plan: TreeSpec, max_budget: int, replay_depth: int, wide_topk: int) -> ReplaySpecs:
        """Best-first at N_max with the plan's topk/depth (a chain or static plan: its depth and
        branching if larger); union with the plan, a wide dynamic tree and a long chain."""
        n_max = max(max_budget, plan.max_nodes)
        depth = max(plan.depth, plan.max_depth)
        topk = max(plan.topk, plan.branching)
        bf = TreeSpec(kind="dynamic", budget=n_max, topk=topk, depth=depth)
        wide = TreeSpec(
            kind="dynamic", budget=n_max, topk=max(topk, wide_topk), depth=max(depth, replay_depth)
        )
        chain = TreeSpec(kind="chain", k=max(replay_depth, plan.max_depth))
        return ReplaySpecs(bf, plan, tuple(dict.fromkeys((bf, plan, wide, chain))))

    def narrowed(self) -> ReplaySpecs:
        """Only the best-first and the plan's trees in the candidate set (an alternative
        drafter's replay: a wide tree and a long chain cost a trained drafter dozens of
        forwards per position)."""
        both = tuple(dict.fromkeys((self.best_first, self.plan)))
        return ReplaySpecs(self.best_first, self.plan, both)


@dataclass
class PromptReplay:
    """Replay of one prompt: per position c = 1 .. T-1 (list index c - 1)."""

    prompt_len: int
    n_out: int
    """T: output tokens of the reference (the first comes from prefill)."""
    best_first: dict[int, list[int]]
    """N -> accepted length of the best-first tree of N nodes."""
    longest: list[int]
    """Longest reference-matching path in the candidate set."""
    plan: list[int]
    """Accepted length of the tree the drafter proposes for the plan itself."""

    @property
    def decode_tokens(self) -> int:
        return self.n_out - 1


DraftTimer = Callable[[int, list[int]], None]
"""Called as ``timer(c, tokens)`` at every position after the replay calls (may time proposes)."""


def replay_prompt(
    drafter: Drafter,
    prompt: Sequence[int],
    out: Sequence[int],
    specs: ReplaySpecs,
    grid: Sequence[int],
    timer: DraftTimer | None = None,
    hidden: Sequence[Tensor] = (),
) -> PromptReplay:
    """Teacher-force ``drafter`` along ``prompt + out`` (begin, propose at every position in
    order, finish) and record the accepted lengths (no target forward). ``hidden``: for drafters
    that read target features, per tapped layer the target's states of ``prompt + out`` (each
    position's new rows go with the first propose there, as the engine sends them)."""
    prompt, out = list(prompt), list(out)
    p, t = len(prompt), len(out)
    res = PromptReplay(p, t, {n: [] for n in grid if n > 0}, [], [])
    drafter.begin(prompt)
    fed = 0
    for c in range(1, t):
        tokens = prompt + out[:c]
        cont = out[c:]
        trees = {}
        for s in specs.union:
            rows = tuple(h[fed : len(tokens) - 1] for h in hidden)
            fed = len(tokens) - 1 if hidden else 0
            trees[s] = drafter.propose(DraftContext(tokens, p, s, rows))
        cand = trees[specs.best_first]
        for n, acc in res.best_first.items():
            acc.append(accepted_length(select_best(cand, n), cont))
        res.plan.append(accepted_length(trees[specs.plan], cont))
        res.longest.append(max(longest_match(tree, cont) for tree in trees.values()))
        if timer is not None:
            timer(c, tokens)
    drafter.finish(prompt + out)
    return res


@dataclass(frozen=True)
class TauCurves:
    grid: tuple[int, ...]
    tau_bf: tuple[float, ...]
    tau_opt: tuple[float, ...]
    tau_plan: float
    """Replay of the plan's own trees (= the engine's tau for a deterministic drafter)."""


def tau_curves(replays: Sequence[PromptReplay], grid: Sequence[int]) -> TauCurves:
    """tau_bf(N), tau_opt(N) and the plan's replayed tau over all prompts (tokens and steps
    summed, then divided). N = 0 (no speculation) gives 1.0 on both curves."""
    tokens = sum(r.decode_tokens for r in replays)
    live = [r for r in replays if r.n_out > 1]
    plan = tokens / sum(greedy_steps(r.plan) for r in live) if live else 1.0
    bf, opt = [], []
    for n in grid:
        if n == 0 or tokens == 0:
            bf.append(1.0)
            opt.append(1.0)
            continue
        bf.append(tokens / sum(greedy_steps(r.best_first[n]) for r in live))
        opt.append(tokens / sum(min_steps(r.longest, n) for r in live))
    return TauCurves(tuple(grid), tuple(bf), tuple(opt), plan)


def time_proposes(
    drafter: Drafter,
    tokens: list[int],
    prompt_len: int,
    specs: dict[int, TreeSpec],
    hidden: Sequence[Tensor] = (),
) -> dict[int, float]:
    """Seconds of one ``propose`` per budget at the current position (drafter already synced;
    a feature drafter gets no new rows: ``hidden`` only gives their shape)."""
    none = tuple(h[:0] for h in hidden)
    out = {}
    for n, spec in specs.items():
        t = time.perf_counter()
        drafter.propose(DraftContext(tokens, prompt_len, spec, none))
        out[n] = time.perf_counter() - t
    return out
