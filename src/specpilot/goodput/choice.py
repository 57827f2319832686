"""One step's verify budget as a pure choice: the draft nodes of highest gain that maximize
expected committed tokens per second under the cost curve, for one sequence, a padded batch
(:func:`choose`) or a packed one (:func:`choose_packed`); and the fixed per-batch-size node
budget's allocation by gain (:func:`allocate_nodes`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specpilot.errors import ConfigError
from specpilot.goodput.cost import CostCurve
from specpilot.tree import DraftTree, subtree

__all__ = ["Choice", "allocate_nodes", "best_nodes", "choose", "choose_packed", "spent_goodput"]


@dataclass(frozen=True)
class Choice:
    """One step's verify budget."""

    width: int
    """Most draft nodes verified per sequence (0 = plain decoding); packed: all nodes."""
    predicted_s: float
    """Predicted step time (verify + drafting)."""
    predicted_tokens: float
    """Predicted committed tokens over the batch."""

    @property
    def goodput(self) -> float:
        return self.predicted_tokens / self.predicted_s if self.predicted_s > 0 else 0.0


def best_nodes(tree: DraftTree, gains: Sequence[float], width: int) -> list[int]:
    """The ``width`` nodes of highest gain, closed over ancestors (ascending indices)."""
    if width >= tree.size:
        return list(range(tree.size))
    order = sorted(range(tree.size), key=lambda i: (-gains[i], i))
    parents = tree.parents.tolist()
    keep: set[int] = set()
    for i in order:
        missing = []
        node = i
        while node >= 0 and node not in keep:
            missing.append(node)
            node = parents[node]
        if len(keep) + len(missing) <= width:
            keep.update(missing)
        if len(keep) >= width:
            break
    return sorted(keep)


def allocate_nodes(
    trees: Sequence[DraftTree], total: int, min_gain: float = 0.0
) -> list[DraftTree]:
    """Keep at most ``total`` nodes over all ``trees``, the ones of highest expected gain.

    The gain of a node is ``exp(score)`` (its path's acceptance probability under the drafter);
    ties go to the shallower node, then round-robin over the requests. Nodes of gain below
    ``min_gain`` are dropped. A node is kept only with its ancestors, so every kept tree stays
    ancestor-closed.

    >>> a = DraftTree.chain([1, 2, 3], [-0.1, -0.2, -2.0])
    >>> b = DraftTree.chain([7, 8], [-0.5, -0.6])
    >>> [t.tokens.tolist() for t in allocate_nodes([a, b], 4)]
    [[1, 2], [7, 8]]
    """
    cands = []
    for r, t in enumerate(trees):
        depths = t.depths.tolist()
        for i, s in enumerate(t.scores.tolist()):
            cands.append((-math.exp(s), depths[i], i, r))
    cands.sort()
    keep: list[set[int]] = [set() for _ in trees]
    parents = [t.parents.tolist() for t in trees]
    used = 0
    for neg_gain, _, i, r in cands:
        if used >= total or -neg_gain < min_gain:
            break
        missing = []
        node = i
        while node >= 0 and node not in keep[r]:
            missing.append(node)
            node = parents[r][node]
        if used + len(missing) <= total:
            keep[r].update(missing)
            used += len(missing)
    return [
        t if len(k) == t.size else subtree(t, sorted(k)) for t, k in zip(trees, keep, strict=True)
    ]


def spent_goodput(c: Choice, draft_s: float) -> float:
    """Predicted tokens per second of choice ``c`` after ``draft_s`` seconds of drafting: a
    choice of nodes already counts it (:func:`choose`), plain decoding does not (it is the
    alternative to drafting), yet a step that drafted and then chose it spent that time.

    >>> round(spent_goodput(Choice(0, 0.010, 8.0), 0.005), 1)  # plain, after 5 ms of drafting
    533.3
    >>> round(spent_goodput(Choice(2, 0.015, 10.0), 0.005), 1)  # nodes: already in the 15 ms
    666.7
    """
    spent = c.predicted_s + (draft_s if c.width == 0 else 0.0)
    return c.predicted_tokens / spent if spent > 0 else 0.0


def choose(
    gains: Sequence[Sequence[float]],
    curve: CostCurve,
    draft_s: float,
    max_width: int | None = None,
) -> Choice:
    """The width ``w`` maximizing ``(B + sum of each sequence's w best gains) /
    (curve(B * (w + 1)) + draft_s if w > 0)``; ``w = 0`` is plain decoding without drafting.

    >>> curve = CostCurve([1, 8], [0.010, 0.017])
    >>> choose([[0.9, 0.8, 0.5]], curve, draft_s=0.001).width     # good drafts: take them
    3
    >>> choose([[0.05, 0.01]], curve, draft_s=0.001).width        # useless drafts: plain
    0
    """
    b = len(gains)
    ranked = [sorted(g, reverse=True) for g in gains]
    most = max((len(g) for g in ranked), default=0)
    if max_width is not None:
        most = min(most, max_width)
    best = Choice(0, curve(b), float(b))
    acc = 0.0
    for w in range(1, most + 1):
        acc += sum(g[w - 1] for g in ranked if len(g) >= w)
        c = Choice(w, curve(b * (w + 1)) + draft_s, b + acc)
        if c.goodput > best.goodput:
            best = c
    return best


def choose_packed(
    gains: Sequence[Sequence[float]],
    curve: CostCurve,
    draft_s: float,
    max_nodes: int | None = None,
    seq_s: float = 0.0,
) -> tuple[Choice, list[int]]:
    """Packed verify (rows = B + nodes): the ``n`` nodes of highest gain over the whole batch
    maximizing ``(B + their gains) / (curve(B + n) + seq_s * S + draft_s if n > 0)``, ``S`` the
    sequences those nodes fall in (``seq_s``: what verifying a tree costs a sequence beside
    its rows: accepting and committing it); the choice and the nodes it gives each sequence.

    >>> curve = CostCurve([1, 4, 8], [0.010, 0.011, 0.020])
    >>> choose_packed([[0.9, 0.2], [0.8, 0.1]], curve, draft_s=0.0)[1]
    [1, 1]
    >>> choose_packed([[0.9, 0.2], [0.8, 0.1]], curve, draft_s=0.0, seq_s=0.005)[1]  # too dear
    [0, 0]
    """
    b = len(gains)
    items = sorted(((g, i) for i, gs in enumerate(gains) for g in gs), reverse=True)
    if max_nodes is not None:
        items = items[:max_nodes]
    best, best_n = Choice(0, curve(b), float(b)), 0
    acc = 0.0
    seqs: set[int] = set()
    for n, (g, i) in enumerate(items, start=1):
        acc += g
        seqs.add(i)
        c = Choice(n, curve(b + n) + seq_s * len(seqs) + draft_s, b + acc)
        if c.goodput > best.goodput:
            best, best_n = c, n
    counts = [0] * b
    for _, i in items[:best_n]:
        counts[i] += 1
    return best, counts


DEFAULT_BUDGET_TABLE: tuple[tuple[int, int], ...] = ((1, 16), (2, 8), (4, 6), (8, 4), (16, 2))
"""(batch size, draft nodes per sequence): the entry with the largest batch size <= B applies."""


@dataclass(frozen=True)
class VerifyBudget:
    """Draft nodes verified per step as a function of the batch size."""

    table: tuple[tuple[int, int], ...] = DEFAULT_BUDGET_TABLE
    """(batch size, nodes per sequence) pairs, batch sizes ascending from 1; the batch's total
    node budget is B x the entry for the largest batch size <= B."""

    def __post_init__(self) -> None:
        sizes = [b for b, _ in self.table]
        if not self.table or sizes[0] != 1 or sizes != sorted(set(sizes)):
            raise ConfigError(
                f"verify budget table must start at batch size 1 with ascending sizes, "
                f"got {list(self.table)}"
            )
        if any(n < 0 for _, n in self.table):
            raise ConfigError(f"verify budget nodes must be >= 0, got {list(self.table)}")

    @staticmethod
    def from_table(table: Mapping[int, int], default: int) -> VerifyBudget:
        """From a plan's ``batch_budget`` table (batch size -> nodes per sequence); batch sizes
        below its smallest entry get ``default`` (e.g. the tree's own node count)."""
        pairs = {int(b): int(n) for b, n in table.items()}
        pairs.setdefault(1, default)
        return VerifyBudget(tuple(sorted(pairs.items())))

    def per_sequence(self, batch: int) -> int:
        return next(n for b, n in reversed(self.table) if b <= max(batch, 1))

    def total(self, batch: int) -> int:
        return batch * self.per_sequence(batch)
