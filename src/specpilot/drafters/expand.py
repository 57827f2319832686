"""Tree expansion for drafters that score one depth per forward (EAGLE-2 style), as pure functions.

The drafter supplies ``feed(nodes, rows) -> (len(rows), V) log-probs``: one batched forward of
the listed nodes (each sees its ancestors); these functions decide which nodes to feed.

* :func:`expand_dynamic` - EAGLE-2 (Li et al. 2024): per depth the ``topk`` nodes with the best
  cumulative log-probability are expanded in one forward, each adds its ``topk`` children; the
  tree spec keeps the best ``budget`` nodes at the end.
* :func:`expand_paths` - chains and static trees: only the prefixes the rank paths extend.

Token ids in the returned tree are indices into the drafter's output vocabulary (``V``); a
drafter with a reduced vocabulary maps them back (``vocab_ids[tree.tokens]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from torch import Tensor

from specpilot.tree import DraftTree, TreeSpec, shape_tree


def chain_paths(k: int) -> tuple[tuple[int, ...], ...]:
    """A chain of ``k`` as rank paths: (0,), (0, 0), ..."""
    return tuple((0,) * i for i in range(1, k + 1))


def path_widths(paths: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    """Rank-path prefix -> how many ranked children it needs (() is the root).

    >>> path_widths([(0,), (1,), (0, 0)])
    {(): 2, (0,): 1}
    """
    need: dict[tuple[int, ...], int] = {}
    for p in paths:
        for i, r in enumerate(p):
            need[p[:i]] = max(need.get(p[:i], 0), r + 1)
    return need


class Nodes:
    """Growing draft tree: per node its token, parent, depth, score and cache slot."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self.anc_slots: list[list[int]] = []
        """Cache slots of the node's fed ancestors and itself (filled when it is fed)."""

    def add(self, tok: int, parent: int, score: float) -> int:
        self.tokens.append(tok)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        self.anc_slots.append([])
        return len(self.tokens) - 1

    def tree(self) -> DraftTree:
        return DraftTree.from_parents(self.tokens, self.parents, self.scores)


Feed = Callable[[Nodes, list[int]], Tensor]
"""feed(nodes, rows) -> (len(rows), V) log-probs of the children of ``rows``."""


def expand_dynamic(
    root: Tensor, feed: Feed, spec: TreeSpec, min_logp: float = -math.inf
) -> DraftTree:
    """EAGLE-2 expansion from the root's log-probs ``root`` (V,); nodes whose cumulative
    log-probability is below ``min_logp`` are not expanded (each depth costs a forward)."""
    k = min(spec.topk, root.shape[-1])
    nodes = Nodes()
    vals, idx = root.topk(k)
    level = [nodes.add(t, -1, v) for v, t in zip(vals.tolist(), idx.tolist(), strict=True)]
    for _ in range(1, spec.depth):
        frontier = sorted(level, key=lambda i: (-nodes.scores[i], i))[:k]
        frontier = [i for i in frontier if nodes.scores[i] >= min_logp]
        if not frontier:
            break
        lp = feed(nodes, frontier)  # (len(frontier), V)
        vals, idx = lp.topk(k, dim=-1)
        level = []
        for r, i in enumerate(frontier):
            base = nodes.scores[i]
            for v, t in zip(vals[r].tolist(), idx[r].tolist(), strict=True):
                level.append(nodes.add(t, i, base + v))
    return shape_tree(nodes.tree(), spec)


def expand_spec(root: Tensor, feed: Feed, spec: TreeSpec, min_logp: float = -math.inf) -> DraftTree:
    """Expand for any tree spec (dynamic, static or chain)."""
    if spec.kind == "dynamic":
        return expand_dynamic(root, feed, spec, min_logp)
    paths = spec.paths if spec.kind == "static" else chain_paths(spec.k)
    return expand_paths(root, feed, paths, spec, min_logp)


def expand_paths(
    root: Tensor,
    feed: Feed,
    paths: Sequence[tuple[int, ...]],
    spec: TreeSpec,
    min_logp: float = -math.inf,
) -> DraftTree:
    """Chain / static tree: expand exactly the prefixes the rank paths extend (and whose
    cumulative log-probability is at least ``min_logp``)."""
    need = path_widths(paths)
    nodes = Nodes()
    prefix: list[tuple[int, ...]] = []
    level: list[int] = []
    for rank, (v, t) in enumerate(_top(root[None], need[()])[0]):
        level.append(nodes.add(t, -1, v))
        prefix.append((rank,))
    for _ in range(1, spec.max_depth):
        frontier = [i for i in level if prefix[i] in need and nodes.scores[i] >= min_logp]
        if not frontier:
            break
        lp = feed(nodes, frontier)
        tops = _top(lp, max(need[prefix[i]] for i in frontier))
        level = []
        for r, i in enumerate(frontier):
            for rank, (v, t) in enumerate(tops[r][: need[prefix[i]]]):
                level.append(nodes.add(t, i, nodes.scores[i] + v))
                prefix.append((*prefix[i], rank))
    return shape_tree(nodes.tree(), spec)


def _top(lp: Tensor, k: int) -> list[list[tuple[float, int]]]:
    """Per row the ``k`` best (log-prob, token), best first; k == 1 is exactly the argmax."""
    # lp: (R, vocab)
    if k == 1:
        idx = lp.argmax(dim=-1, keepdim=True)  # (R, 1)
        vals = lp.gather(-1, idx)
    else:
        vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)  # (R, k)
    return [list(zip(v, t, strict=True)) for v, t in zip(vals.tolist(), idx.tolist(), strict=True)]
