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

A cell's prior is not the drafter's word alone: it is the drafter's probability times the
drafter's observed calibration at that regime and depth, pooled over all probability bins
(accepted nodes / the sum of their probabilities, with ``pool_prior`` pseudo-counts). A suffix
drafter says 1.0 for every node of a unique match; sampled at temperature 1, such nodes were
accepted ~2% of the time, and with the drafter's word as each cell's prior the budget verified
chains of 4-9 nodes for ~25 steps before one cell learned it, and again for each bin it had not
seen (0.93x plain decoding, BENCHMARKS.md). Pooled, what one bin learns lowers the others'
priors, and a cell's own evidence still decides once it has some.

The pool's pseudo-counts trust the drafter at depth 1; at a deeper depth they sit at the
calibration of the depth above times the last step's rate (the depth above's over the one above
it; at depth 2, depth 1's; at most 1): a depth without evidence is judged as one more step of
what the shallower depths showed. (With the drafter's word at every depth, a fresh batch's
suffix drafter had its depth-1 rate of 0.66 carried to depths 2-8 unchanged, and one step
verified 7 nodes for each of 8 sequences: 41 tokens predicted, 13 committed, 72 ms against a 16
ms plain step. Later in that run the same depths read 0.62, 0.47, 0.38, 0.28: the geometric
decay this prior starts from.)

Counts are kept over a sliding ``window`` of observations per cell and per pool (older ones fade
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
    """Pseudo-observations per cell at its prior: the drafter's probability times the pooled
    calibration of its regime and depth (:meth:`calibration`)."""
    pool_prior: float = 2.0
    """Pseudo-counts of the pooled calibration at 1 (the drafter's word)."""
    window: float = 256.0
    """Observations a cell (and a pool) remembers; beyond it, old ones fade proportionally."""
    proposed: dict[Key, float] = field(default_factory=dict)
    accepted: dict[Key, float] = field(default_factory=dict)
    pooled: dict[tuple[int, int], tuple[float, float, float]] = field(default_factory=dict)
    """(regime, depth) -> (observations, accepted, sum of the drafter's probabilities)."""

    @staticmethod
    def _key(depth: int, p: float, regime: int) -> Key:
        return regime, depth, min(BINS - 1, max(0, int(p * BINS)))

    def calibrations(self, depth: int, regime: int = 0) -> list[float]:
        """Accepted nodes per unit of the drafter's probability at depths 1..``depth`` in
        ``regime``, over every bin: with no evidence, 1 at depth 1 (the drafter's word), and at
        a deeper depth the depth above's times the last step's rate (the depth above's over the
        one above it; at depth 2 depth 1's; at most 1); evidence moves each from there
        (``pool_prior`` pseudo-counts).

        >>> stats = AcceptanceStats()
        >>> stats.calibrations(3)
        [1.0, 1.0, 1.0]
        >>> for i in range(18):  # a 'certain' drafter right at depth 1 half the time
        ...     stats.observe(DraftTree.chain([5]), [0] if i % 2 else [])
        >>> [round(c, 3) for c in stats.calibrations(4)]
        [0.55, 0.303, 0.166, 0.092]
        >>> for i in range(18):  # chains of 3: once depth 1 is right, so are depths 2 and 3
        ...     stats.observe(DraftTree.chain([5, 6, 7]), [0, 1, 2] if i % 2 else [])
        >>> [round(c, 3) for c in stats.calibrations(5)]
        [0.526, 0.478, 0.493, 0.493, 0.493]
        """
        out: list[float] = []
        prior = 1.0
        for d in range(1, depth + 1):
            _, a, s = self.pooled.get((regime, d), (0.0, 0.0, 0.0))
            out.append((a + self.pool_prior * prior) / (s + self.pool_prior))
            # one more step at the last depth's rate given the depth above (depth 1's own)
            step = out[-1] / out[-2] if d > 1 and out[-2] > 0 else out[0]
            prior = out[-1] * min(1.0, step)
        return out

    def calibration(self, depth: int, regime: int = 0) -> float:
        """The calibration at ``depth`` (:meth:`calibrations`)."""
        return self.calibrations(depth, regime)[-1]

    def estimate(self, depth: int, p: float, regime: int = 0,
                 calibration: float | None = None) -> float:  # fmt: skip
        """Expected acceptance of a node at ``depth`` whose drafter path probability is ``p``,
        in a sequence in ``regime`` (``calibration``: :meth:`calibration` of that depth, where
        the caller has it)."""
        key = self._key(depth, p, regime)
        n = self.proposed.get(key, 0.0)
        if calibration is None:
            calibration = self.calibration(depth, regime)
        m0 = min(1.0, p * calibration)
        return (self.accepted.get(key, 0.0) + self.prior * m0) / (n + self.prior)

    def observe(self, tree: DraftTree, path: Sequence[int], regime: int = 0) -> None:
        """Count every verified node of ``tree`` (drafted in ``regime``); the nodes on the
        accepted ``path`` count as accepted."""
        if not tree.size:  # a plain step's empty tree: nothing to count (most steps at a batch)
            return
        on_path = set(path)
        self.observe_nodes(tree, range(tree.size), [i in on_path for i in range(tree.size)],
                           regime)  # fmt: skip

    def observe_nodes(self, tree: DraftTree, nodes: Sequence[int], accepted: Sequence[bool],
                      regime: int = 0) -> None:  # fmt: skip
        """Count ``nodes`` of ``tree`` (drafted in ``regime``), ``accepted[j]`` for
        ``nodes[j]`` (verified ones, or unverified ones scored against the tokens committed
        after them: :mod:`specpilot.goodput.shadow`)."""
        depths, scores = tree.depths.tolist(), tree.scores.tolist()
        w = self.window
        for i, ok in zip(nodes, accepted, strict=True):
            p = math.exp(min(scores[i], 0.0))
            key = self._key(depths[i], p, regime)
            n = self.proposed.get(key, 0.0) + 1
            a = self.accepted.get(key, 0.0) + ok
            if n > w:
                a, n = a * w / n, w
            self.proposed[key], self.accepted[key] = n, a
            pn, pa, ps = self.pooled.get((regime, depths[i]), (0.0, 0.0, 0.0))
            pn, pa, ps = pn + 1, pa + ok, ps + p
            if pn > w:
                pa, ps, pn = pa * w / pn, ps * w / pn, w
            self.pooled[(regime, depths[i])] = (pn, pa, ps)


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
    >>> [round(g, 3) for g in node_gains(t, stats)]          # depth 2: capped by its parent
    [0.018, 0.018]
    >>> [round(g, 3) for g in node_gains(t, stats, regime=3)]          # another regime: priors
    [0.9, 0.8]
    """
    if not tree.size:
        return []
    depths, scores = tree.depths.tolist(), tree.scores.tolist()
    parents = tree.parents.tolist()
    cal = stats.calibrations(max(depths), regime)
    out: list[float] = []
    for d, s, par in zip(depths, scores, parents, strict=True):
        g = stats.estimate(d, math.exp(min(s, 0.0)), regime, cal[d - 1])
        out.append(min(g, out[par]) if par >= 0 else g)  # parents come before their children
    return out
