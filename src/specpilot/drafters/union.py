"""Union drafting: a copy drafter's tree and a trained drafter's tree verified as one tree.

Suffix decoding (SuffixDecoding, Oliaro et al. 2024) is precise where the output repeats the
prompt or earlier outputs; a trained head covers everything else. :class:`UnionDrafter` asks
both every step (a trained drafter must see the hidden states of every committed token) and
merges the trees as a trie: the copy drafter's nodes first, with at most ``share`` of the node
budget, then the trained drafter's nodes best-first until the budget is spent. Shared paths are
counted once, so the merged tree never exceeds the budget and is verified in one target step.
"""

from __future__ import annotations

from dataclasses import replace

from specpilot.drafters.base import DraftContext, Drafter
from specpilot.tree import DraftTree, TreeSpec


def union_trees(first: DraftTree, second: DraftTree, budget: int) -> DraftTree:
    """Trie union of two draft trees: all of ``first`` (up to ``budget``), then the best-scored
    nodes of ``second`` whose parent is in the union, until ``budget`` nodes.

    >>> a = DraftTree.chain([5, 6])
    >>> b = DraftTree.from_parents([5, 7, 8], [-1, 0, -1], [-0.1, -0.5, -1.0])
    >>> u = union_trees(a, b, 3)
    >>> u.tokens.tolist(), u.parents.tolist()      # 5 shared; 7 under 5 fits, 8 does not
    ([5, 6, 7], [-1, 0, 0])
    """
    toks: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    index: dict[tuple[int, int], int] = {}  # (parent in union, token) -> union node

    def add(parent: int, tok: int, score: float) -> int | None:
        key = (parent, tok)
        if key in index:
            return index[key]
        if len(toks) >= budget:
            return None
        toks.append(tok)
        parents.append(parent)
        scores.append(score)
        index[key] = len(toks) - 1
        return index[key]

    where: dict[int, int | None] = {}
    ft, fp, fs = first.tokens.tolist(), first.parents.tolist(), first.scores.tolist()
    for i in range(first.size):
        p = -1 if fp[i] < 0 else where.get(fp[i])
        where[i] = None if p is None else add(p, ft[i], fs[i])
    where = {}
    st, sp, ss = second.tokens.tolist(), second.parents.tolist(), second.scores.tolist()
    depth = second.depths.tolist()
    for i in sorted(range(second.size), key=lambda i: (-ss[i], depth[i], i)):
        if sp[i] >= 0 and where.get(sp[i]) is None:
            where[i] = None
            continue
        where[i] = add(-1 if sp[i] < 0 else where[sp[i]], st[i], ss[i])  # type: ignore[arg-type]
    if not toks:
        return DraftTree.empty()
    return DraftTree.from_parents(toks, parents, scores)


class UnionDrafter:
    """``copy`` (e.g. suffix) and ``trained`` (e.g. the head) drafters merged into one tree."""

    def __init__(self, copy: Drafter, trained: Drafter, share: float = 0.5) -> None:
        self.copy, self.trained, self.share = copy, trained, share
        self.name = f"{trained.name}+{copy.name}"
        self.hidden_layers = tuple(trained.hidden_layers)

    def begin(self, prompt: list[int]) -> None:
        self.copy.begin(prompt)
        self.trained.begin(prompt)

    def propose(self, ctx: DraftContext) -> DraftTree:
        spec = ctx.spec
        b = self.trained.propose(ctx)
        limit = max(1, int(spec.max_nodes * self.share))
        small = _limit(spec, limit)
        a = self.copy.propose(DraftContext(ctx.tokens, ctx.prompt_len, small))
        return union_trees(a, b, spec.max_nodes)

    def finish(self, tokens: list[int]) -> None:
        self.copy.finish(tokens)
        self.trained.finish(tokens)


def _limit(spec: TreeSpec, n: int) -> TreeSpec:
    """The same shape with at most ``n`` nodes."""
    if spec.kind == "chain":
        return replace(spec, k=min(spec.k, n))
    if spec.kind == "dynamic":
        return replace(spec, budget=min(spec.budget, n))
    return spec
