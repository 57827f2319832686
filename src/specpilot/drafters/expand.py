"""Trees for drafters that score one depth per forward (draft model, trained head).

The drafter supplies ``feed(nodes, rows) -> (len(rows), V) log-probs``: one batched forward of
the listed nodes of the growing tree (each sees its ancestors). :func:`expand_spec` turns it into
the children function of :func:`specpilot.tree.build_tree`: dynamic trees grow level by level
(EAGLE-2: the ``topk`` best nodes of a depth in one forward), chains and static trees along their
rank paths. A fed node's ``states`` entry is the drafter's to fill (the cache slots of the node
and its ancestors).

Token ids in the returned tree are indices into the drafter's output vocabulary (``V``); a
drafter with a reduced vocabulary maps them back (``vocab_ids[tree.tokens]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor

from specpilot.tree import Children, Continuation, DraftTree, GrowingTree, TreeSpec, build_tree

Feed = Callable[[GrowingTree, list[int]], Tensor]
"""feed(nodes, rows) -> (len(rows), V) log-probs of the children of ``rows``."""


def log_prob_children(root: Tensor, feed: Feed, exact_argmax: bool) -> Children:
    """Children from the root's log-probs ``root`` (V,) and ``feed`` for the nodes below it.

    ``exact_argmax``: a width of 1 takes exactly the argmax (rank paths); else ``topk``."""

    def children(nodes: GrowingTree, frontier: list[int], width: int) -> list[list[Continuation]]:
        lp = root[None] if frontier == [-1] else feed(nodes, frontier)  # (R, V)
        return top_children(lp, width, exact_argmax)

    return children


def expand_spec(root: Tensor, feed: Feed, spec: TreeSpec, min_logp: float = -math.inf) -> DraftTree:
    """The tree of ``spec`` (dynamic, static or chain) below the root's log-probs ``root``."""
    dynamic = spec.kind == "dynamic"
    children = log_prob_children(root, feed, exact_argmax=not dynamic)
    return build_tree(children, spec, dynamic="levels", min_logp=min_logp)


def top_children(lp: Tensor, k: int, exact_argmax: bool) -> list[list[Continuation]]:
    """Per row the ``k`` best (log-prob, token, None), best first."""
    # lp: (R, vocab)
    if k == 1 and exact_argmax:
        idx = lp.argmax(dim=-1, keepdim=True)  # (R, 1)
        vals = lp.gather(-1, idx)
    else:
        vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)  # (R, k)
    return [
        [(v, t, None) for v, t in zip(vr, tr, strict=True)]
        for vr, tr in zip(vals.tolist(), idx.tolist(), strict=True)
    ]
