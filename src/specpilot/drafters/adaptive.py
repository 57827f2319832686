"""Adaptive draft length by draft confidence: cut the tree where the path score drops too low.

Every drafter scores its nodes with a cumulative draft log-probability (path score). Verifying a
node whose path is unlikely costs a verify row and rarely pays; DSpark's confidence head and
EAGLE-2's dynamic depth act on the same signal. This wrapper keeps the nodes whose path score is
at least ``log(threshold)`` (and all their ancestors: a child never scores above its parent, and
closure is enforced anyway), but never fewer than ``min_nodes`` of the best ones, so a confident
drafter drafts long and an unsure one drafts short.

    >>> from specpilot.tree import DraftTree
    >>> t = DraftTree.chain([5, 6, 7], [-0.1, -0.9, -2.5])
    >>> truncate(t, threshold=0.3, min_nodes=1).tokens.tolist()   # exp(-0.9) = 0.41 >= 0.3
    [5, 6]
"""

from __future__ import annotations

import math

from specpilot.drafters.base import DraftContext, Drafter
from specpilot.errors import DrafterError
from specpilot.tree import DraftTree, select_best, subtree


def truncate(tree: DraftTree, threshold: float, min_nodes: int = 1) -> DraftTree:
    """Nodes of ``tree`` with path score >= log(threshold), ancestor-closed, at least the best
    ``min_nodes``."""
    if tree.size == 0:
        return tree
    floor = math.log(threshold)
    scores = tree.scores.tolist()
    parents = tree.parents.tolist()
    keep = [False] * tree.size
    for i in range(tree.size):  # topological order: a parent is decided before its child
        p = parents[i]
        keep[i] = scores[i] >= floor and (p < 0 or keep[p])
    kept = [i for i in range(tree.size) if keep[i]]
    if len(kept) >= min(min_nodes, tree.size):
        return subtree(tree, kept) if len(kept) < tree.size else tree
    return select_best(tree, min_nodes)


class ConfidenceDrafter:
    """Wraps a drafter; its trees are cut by :func:`truncate`."""

    def __init__(self, inner: Drafter, threshold: float, min_nodes: int = 1) -> None:
        if not 0.0 < threshold <= 1.0:
            raise DrafterError(f"confidence threshold must be in (0, 1], got {threshold}")
        if min_nodes < 0:
            raise DrafterError(f"confidence min_nodes must be >= 0, got {min_nodes}")
        self.inner, self.threshold, self.min_nodes = inner, threshold, min_nodes
        self.name = inner.name
        self.hidden_layers = tuple(inner.hidden_layers)
        self.cut_nodes = 0
        """Draft nodes removed so far (reports read it)."""

    def begin(self, prompt: list[int]) -> None:
        self.inner.begin(prompt)

    def propose(self, ctx: DraftContext) -> DraftTree:
        tree = self.inner.propose(ctx)
        out = truncate(tree, self.threshold, self.min_nodes)
        self.cut_nodes += tree.size - out.size
        return out

    def finish(self, tokens: list[int]) -> None:
        self.inner.finish(tokens)
