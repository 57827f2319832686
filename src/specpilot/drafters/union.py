"""Union drafting: a copy drafter's tree and a trained drafter's tree verified as one tree.

Suffix decoding (SuffixDecoding, Oliaro et al. 2024) is precise where the output repeats the
prompt or earlier outputs; a trained head covers everything else. :class:`UnionDrafter` asks
both every step (a trained drafter must see the hidden states of every committed token) and
merges the trees as a trie: the copy drafter's nodes first, with at most ``share`` of the node
budget, then the trained drafter's nodes best-first until the budget is spent. Shared paths are
counted once, so the merged tree never exceeds the budget and is verified in one target step.

With ``trust`` > 0 the copy drafter goes first and, when its tree comes from a matched pattern
of at least ``trust`` tokens (long verbatim repeats: code, quoted context), that tree is used
alone with the whole budget and the trained drafter is not run at all: its forwards cost
about as much as a small verify step. The target states of the tokens committed meanwhile are
kept and fed to the trained drafter in one batch when it is next asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from specpilot.drafters.base import DraftContext, Drafter, propose_all
from specpilot.errors import DrafterError
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

    def __init__(
        self,
        copy: Drafter,
        trained: Drafter,
        share: float = 0.5,
        trust: int = 0,
        trained_depth: int = 0,
    ) -> None:
        """``share``: most of the node budget the copy drafter's nodes take in a merged tree;
        ``trust``: copy-alone steps from matches of this many tokens (0 = always merge);
        ``trained_depth``: the trained drafter's trees are cut to this depth (0 = the spec's;
        its acceptance falls fast with depth while every depth costs a forward)."""
        if not 0.0 < share <= 1.0:
            raise DrafterError(f"union share must be in (0, 1], got {share}")
        if not isinstance(trust, int) or trust < 0:
            raise DrafterError(f"union trust must be an integer >= 0 (0 = merge), got {trust!r}")
        if not isinstance(trained_depth, int) or trained_depth < 0:
            raise DrafterError(f"union trained_depth must be an integer >= 0, got {trained_depth}")
        self.copy, self.trained, self.share, self.trust = copy, trained, share, trust
        self.trained_depth = trained_depth
        self.name = f"{trained.name}+{copy.name}"
        self.hidden_layers = tuple(trained.hidden_layers)
        self.copy_steps = 0
        """Steps answered by the copy drafter alone (``trust``); reports read it."""
        self._pending: list[tuple[Tensor, ...]] = []
        self.last_cheap = DraftTree.empty()
        """The copy drafter's own tree in the last :meth:`propose` (the whole budget's when
        ``trust`` asked it first; :class:`~specpilot.drafters.base.Tiered`)."""

    def begin(self, prompt: list[int]) -> None:
        self.copy.begin(prompt)
        self.trained.begin(prompt)
        self._pending = []
        self.last_cheap = DraftTree.empty()

    def batch_key(self) -> object:
        """Unions draft together: their trained parts batch by their own keys
        (:func:`~specpilot.drafters.base.propose_all`)."""
        return None

    @staticmethod
    def propose_batch(
        unions: Sequence[UnionDrafter], ctxs: Sequence[DraftContext]
    ) -> list[DraftTree]:
        """Each union's tree; the trained drafters of those that need them in one
        :func:`~specpilot.drafters.base.propose_all`."""
        first = [u._start(c) for u, c in zip(unions, ctxs, strict=True)]
        ask = [i for i, f in enumerate(first) if isinstance(f, DraftContext)]
        trained = propose_all([unions[i].trained for i in ask], [first[i] for i in ask])  # type: ignore[misc]
        for i, b in zip(ask, trained, strict=True):
            first[i] = unions[i]._end(ctxs[i], b)
        return first  # type: ignore[return-value]

    def propose(self, ctx: DraftContext) -> DraftTree:
        return UnionDrafter.propose_batch([self], [ctx])[0]

    def _start(self, ctx: DraftContext) -> DraftTree | DraftContext:
        """The copy drafter's tree alone when it is trusted (``trust``), else the trained
        drafter's context (the target states it skipped included, cut to ``trained_depth``)."""
        spec = ctx.spec
        if self.trust:
            alone = self.copy.propose(DraftContext(ctx.tokens, ctx.prompt_len, spec))
            self.last_cheap = alone
            if alone.size and getattr(self.copy, "last_match", 0) >= self.trust:
                if ctx.hidden:
                    self._pending.append(ctx.hidden)
                self.copy_steps += 1
                return alone
        tctx = self._with_pending(ctx)
        if self.trained_depth:
            tctx = replace(tctx, spec=_shallow(spec, self.trained_depth))
        return tctx

    def _end(self, ctx: DraftContext, trained: DraftTree) -> DraftTree:
        """The merged tree of the trained drafter's ``trained`` and the copy drafter's share."""
        spec = ctx.spec
        limit = max(1, int(spec.max_nodes * self.share))
        small = _limit(spec, limit)
        a = self.copy.propose(DraftContext(ctx.tokens, ctx.prompt_len, small))
        if not self.trust:
            self.last_cheap = a
        return union_trees(a, trained, spec.max_nodes)

    def propose_cheap(self, ctx: DraftContext) -> DraftTree:
        """The copy drafter's tree alone with the whole budget; the target states of ``ctx``
        wait for the trained drafter's next draft (:class:`~specpilot.drafters.base.Tiered`)."""
        if ctx.hidden:
            self._pending.append(ctx.hidden)
        self.last_cheap = self.copy.propose(DraftContext(ctx.tokens, ctx.prompt_len, ctx.spec))
        return self.last_cheap

    def _with_pending(self, ctx: DraftContext) -> DraftContext:
        """``ctx`` with the target states of every step the trained drafter skipped."""
        if not self._pending:
            return ctx
        parts = [*self._pending, ctx.hidden] if ctx.hidden else self._pending
        self._pending = []
        hidden = tuple(torch.cat(layer, dim=0) for layer in zip(*parts, strict=True))
        return replace(ctx, hidden=hidden)

    def finish(self, tokens: list[int]) -> None:
        self.copy.finish(tokens)
        self.trained.finish(tokens)
        self._pending = []


def _limit(spec: TreeSpec, n: int) -> TreeSpec:
    """The same shape with at most ``n`` nodes."""
    if spec.kind == "chain":
        return replace(spec, k=min(spec.k, n))
    if spec.kind == "dynamic":
        return replace(spec, budget=min(spec.budget, n))
    return spec


def _shallow(spec: TreeSpec, depth: int) -> TreeSpec:
    """The same shape cut to ``depth``."""
    if spec.kind == "chain":
        return replace(spec, k=min(spec.k, depth))
    if spec.kind == "dynamic":
        return replace(spec, depth=min(spec.depth, depth))
    return replace(spec, paths=tuple(p for p in spec.paths if len(p) <= depth))
