"""Acceptance estimates of the goodput budget: a drafter's path probability calibrated against
observed acceptance, per *regime*, depth and probability bin.

The regime is a sequence's recent record (:func:`next_regime`): how many drafted steps in a row
had their whole verified path accepted, up to a leaf of the tree (0 .. ``REGIMES - 1``). Acceptance
is bursty: a sequence that copies from its prompt accepts everything for tens of steps, then
nothing. Pooled over all steps, the deep nodes of a copy run were judged by the steps where the
drafter was wrong: a suffix drafter (every path probability 1) kept one node per step through
fifty steps that accepted every node offered (HumanEval int8, BENCHMARKS.md). Per regime, a run
of full acceptances lands in a cell of its own, whose prior (the drafter's own probability)
tries the deeper nodes, and whose evidence then decides.

Counts are kept over a sliding ``window`` of observations per cell (older ones fade
proportionally), so a cell follows a drafter whose accuracy changes with the text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from specpilot.tree import DraftTree

BINS = 10
"""Probability bins per depth in :class:`AcceptanceStats`."""
REGIMES = 4
"""Regimes: 0 (the last drafted step rejected a node, or none yet) .. 3 (three or more drafted
steps in a row accepted their whole path)."""

Key = tuple[int, int, int]
"""(regime, depth, probability bin)."""


def next_regime(regime: int, tree: DraftTree, path: Sequence[int]) -> int:
    """The regime after a step that verified ``tree`` and accepted ``path`` (node indices, root
    to leaf): one more when the path ends at a leaf of the tree, 0 when it stopped short (a node
    was rejected), unchanged by a step without draft nodes.

    >>> t = DraftTree.chain([4, 5])
    >>> next_regime(1, t, [0, 1]), next_regime(3, t, [0, 1]), next_regime(2, t, [0])
    (2, 3, 0)
    >>> next_regime(2, DraftTree.empty(), [])
    2
    """
    if tree.size == 0:
        return regime
    if path and path[-1] not in set(tree.parents.tolist()):
        return min(regime + 1, REGIMES - 1)
    return 0


@dataclass
class AcceptanceStats:
    """Calibration of draft path probabilities against observed acceptance (see the module
    docstring)."""

    prior: float = 4.0
    """Pseudo-observations at the drafter's own probability per cell."""
    window: float = 256.0
    """Observations a cell remembers; beyond it, old ones fade proportionally."""
    proposed: dict[Key, float] = field(default_factory=dict)
    accepted: dict[Key, float] = field(default_factory=dict)

    @staticmethod
    def _key(depth: int, p: float, regime: int) -> Key:
        return regime, depth, min(BINS - 1, max(0, int(p * BINS)))

    def estimate(self, depth: int, p: float, regime: int = 0) -> float:
        """Expected acceptance of a node at ``depth`` whose drafter path probability is ``p``,
        in a sequence in ``regime``."""
        key = self._key(depth, p, regime)
        n = self.proposed.get(key, 0.0)
        return (self.accepted.get(key, 0.0) + self.prior * p) / (n + self.prior)

    def observe(self, tree: DraftTree, path: Sequence[int], regime: int = 0) -> None:
        """Count every verified node of ``tree`` (drafted in ``regime``); the nodes on the
        accepted ``path`` count as accepted."""
        on_path = set(path)
        depths, scores = tree.depths.tolist(), tree.scores.tolist()
        for i in range(tree.size):
            key = self._key(depths[i], math.exp(min(scores[i], 0.0)), regime)
            n = self.proposed.get(key, 0.0) + 1
            a = self.accepted.get(key, 0.0) + (i in on_path)
            if n > self.window:
                a, n = a * self.window / n, self.window
            self.proposed[key], self.accepted[key] = n, a


def node_gains(tree: DraftTree, stats: AcceptanceStats, regime: int = 0) -> list[float]:
    """Calibrated expected acceptance per node of ``tree`` (drafted in ``regime``), capped by its
    parent's: a node is accepted only with its whole path, so it cannot be likelier than its
    parent. (Calibrated per depth, a deep bin that is rarely verified keeps its prior; uncapped,
    it outranked the depth-1 node it hangs under, and a drafter that was never right kept one
    node verified per step: the budget counted the deep node's gain for the shallow node's
    cost.)

    >>> t = DraftTree.chain([7, 8], [math.log(0.9), math.log(0.8)])
    >>> stats = AcceptanceStats(prior=1.0)
    >>> for _ in range(9):
    ...     stats.observe(DraftTree.chain([7], [math.log(0.9)]), [])   # depth 1 never accepted
    >>> [round(g, 3) for g in node_gains(t, stats)]                    # depth 2 keeps its prior
    [0.09, 0.09]
    >>> [round(g, 3) for g in node_gains(t, stats, regime=3)]          # another regime: priors
    [0.9, 0.8]
    """
    depths, scores = tree.depths.tolist(), tree.scores.tolist()
    parents = tree.parents.tolist()
    out: list[float] = []
    for d, s, par in zip(depths, scores, parents, strict=True):
        g = stats.estimate(d, math.exp(min(s, 0.0)), regime)
        out.append(min(g, out[par]) if par >= 0 else g)  # parents come before their children
    return out
