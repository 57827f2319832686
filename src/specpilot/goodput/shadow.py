"""Acceptance evidence from draft nodes that were not verified.

The goodput budget verifies only the nodes that pay; the others, and every node of a step that
chose plain decoding, used to teach the acceptance statistics nothing. A drafter's word then
stood as long as plain decoding won: a suffix drafter says 1.0 for every node of a unique
match, and at temperature 1 such nodes were accepted ~2% of the time, yet the budget learned it
only from the chains it paid to verify (BENCHMARKS.md).

A deterministic draft (``tree.q is None``: lookup, suffix, top-k heads) is accepted exactly up
to the longest path whose tokens equal the tokens committed after its root: greedy verification
accepts the argmax, and the sampled verification of such drafts accepts a child when the
target's own sample (the same draw plain decoding makes) equals it. So once the next tokens are
committed, every unverified node can be scored as if it had been verified. :class:`Shadow` keeps
each step's unverified nodes per sequence until the tokens after them decide them (at most the
tree's depth in tokens), then counts them in :class:`~specpilot.goodput.AcceptanceStats` like
verified ones. Sampled trees (``q`` set: rejection sampling) are not scored. Nothing here
touches verification: the output is plain decoding's either way.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from specpilot.goodput.acceptance import AcceptanceStats
from specpilot.tree import DraftTree

__all__ = ["Shadow", "decide"]


def decide(tree: DraftTree, after: Sequence[int]) -> list[bool | None]:
    """Per node of ``tree``: True if its whole path equals the start of ``after`` (the tokens
    committed after its root), False if not, None while ``after`` is too short to tell.

    >>> t = DraftTree.from_parents([5, 6, 9, 7], [-1, 0, 0, -1])
    >>> decide(t, [5]), decide(t, [5, 9]), decide(t, [7])
    ([True, None, None, False], [True, False, True, False], [False, False, False, True])
    """
    return _decide(tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist(), after)


def _decide(tokens: list[int], parents: list[int], depths: list[int],
            after: Sequence[int]) -> list[bool | None]:  # fmt: skip
    out: list[bool | None] = []
    for tok, par, d in zip(tokens, parents, depths, strict=True):
        up = True if par < 0 else out[par]
        if up is not True:  # under a rejected node: rejected; under an undecided one: undecided
            out.append(up)
        elif d <= len(after):
            out.append(tok == after[d - 1])
        else:
            out.append(None)
    return out


@dataclass
class _Entry:
    tree: DraftTree
    skip: frozenset[int]
    """Nodes that were verified (counted by the step itself)."""
    regime: int
    lists: tuple[list[int], list[int], list[int]]
    """The tree's tokens, parents and depths (read once, not at every step it waits)."""
    after: list[int] = field(default_factory=list)


@dataclass
class Shadow:
    """Unverified draft nodes per sequence, waiting for the tokens that decide them."""

    pending: dict[Hashable, list[_Entry]] = field(default_factory=dict)

    def note(self, key: Hashable, tree: DraftTree, verified: Sequence[int], regime: int) -> None:
        """A tree drafted for sequence ``key`` whose nodes ``verified`` (indices into it) were
        verified this step; the rest wait for :meth:`advance`. Sampled trees are skipped."""
        if tree.q is not None or tree.size <= len(verified):
            return
        lists = (tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist())
        self.pending.setdefault(key, []).append(_Entry(tree, frozenset(verified), regime, lists))

    def advance(self, key: Hashable, tokens: Sequence[int], stats: AcceptanceStats) -> None:
        """``tokens`` were committed for ``key``: count the nodes they decide in ``stats``."""
        entries = self.pending.get(key)
        if not entries:
            return
        left = []
        for e in entries:
            e.after.extend(tokens)
            status = _decide(*e.lists, e.after)
            if any(s is None for s in status):
                left.append(e)
                continue
            nodes = [i for i in range(e.tree.size) if i not in e.skip]
            stats.observe_nodes(e.tree, nodes, [bool(status[i]) for i in nodes], e.regime)
        if left:
            self.pending[key] = left
        else:
            del self.pending[key]

    def forget(self, key: Hashable) -> None:
        """Sequence ``key`` ended (or restarted): its undecided nodes are dropped."""
        self.pending.pop(key, None)

    def clear(self) -> None:
        self.pending.clear()
