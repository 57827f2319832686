"""Goodput-driven verify budget: how many draft nodes to verify this step, for one sequence or a
batch, by expected committed tokens per second.

Three parts, each a small pure piece (the engines own the state):

* :class:`CostCurve` - verify step seconds as a function of the rows in the target forward,
  measured (:func:`calibrate_curve`; the verify forwards, once per machine, model and plan and
  kept on disk: :mod:`specpilot.goodput.curve`) and refreshed online from observed steps;
* :class:`AcceptanceStats` - a drafter's path probability (``exp(score)``) calibrated against
  observed acceptance, per drafter, regime (the sequence's recent run of fully accepted steps)
  and depth (a probability bin per depth, with a prior that trusts the drafter until evidence
  arrives; :mod:`specpilot.goodput.acceptance`);
* :func:`choose` - per step, over all live sequences, the draft nodes that maximize
  ``(B + expected accepted) / (t_verify(rows) + t_draft)``, zero nodes (plain decoding, no
  drafting) included, with hysteresis (:class:`Selector`) so the choice does not flap.

Rows. A packed batched verify (``specpilot.verify``, ``packed=True``) costs the rows its trees
have, ``B + nodes``: :func:`choose_packed` spends nodes where they pay most over the whole
batch. Padded, every sequence costs the widest tree's rows, ``B * (w + 1)``: :func:`choose` picks
``w`` and keeps each sequence's ``w`` best nodes. One sequence is the same rule with ``B = 1``:
a drafter that rarely matches decays to plain decoding.

Lossless: the selector only drops draft nodes (a subtree of the drafter's tree); verification
and acceptance are unchanged, so the output is plain decoding's token for token.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specpilot.errors import ConfigError
from specpilot.goodput.acceptance import BINS, REGIMES, AcceptanceStats, next_regime, node_gains
from specpilot.tree import DraftTree, subtree

__all__ = [
    "BINS",
    "CALIBRATION_ROWS",
    "REGIMES",
    "AcceptanceStats",
    "Choice",
    "CostCurve",
    "Selector",
    "best_nodes",
    "calibrate_curve",
    "calibration_shape",
    "choose",
    "choose_packed",
    "next_regime",
    "node_gains",
]


@dataclass
class CostCurve:
    """Verify step seconds by rows in the forward: piecewise linear through measured points
    (made non-decreasing: a noisy point never makes more rows look cheaper), extrapolated with the
    last segment's slope."""

    rows: list[int]
    """Measured row counts, ascending, at least one."""
    seconds: list[float]
    smoothing: float = 0.2
    """Weight of an observed step in :meth:`observe` (exponential moving average)."""

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.seconds):
            raise ConfigError("a cost curve needs one time per measured row count")
        if self.rows != sorted(set(self.rows)) or self.rows[0] < 1:
            raise ConfigError(f"cost curve rows must be ascending and >= 1, got {self.rows}")
        if len(self.base) != len(self.seconds):
            self.base = list(self.seconds)

    def __call__(self, rows: int) -> float:
        xs = self.rows
        ys = list(itertools.accumulate(self.seconds, max))  # more rows never cost less
        if rows <= xs[0] or len(xs) == 1:
            return ys[0]
        for i in range(1, len(xs)):
            if rows <= xs[i]:
                f = (rows - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + f * (ys[i] - ys[i - 1])
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + max(slope, 0.0) * (rows - xs[-1])

    observed: list[float] = field(default_factory=list)
    """Observed steps per point, by interpolation weight (:meth:`observe`)."""
    base: list[float] = field(default_factory=list)
    """The calibration's readings (the points never observed follow them: :meth:`_follow`)."""

    def observe(self, rows: int, seconds: float) -> None:
        """Move the curve at ``rows`` toward an observed step time: the two measured points
        around it, each by its interpolation weight (an online least-squares step; a 6-row step
        moved the 8-row point all the way to its own time when only the nearest point learned).
        Points never observed yet follow the level: they hold the calibration's only, and a
        level that was off would otherwise stay wrong exactly where the selector, believing it,
        never verifies. Down by the same factor (a calibration on a disturbed moment is slow by
        a factor), up by the same seconds (what a real step adds to the calibration's bare
        forward - accepting, a longer context, caches the drafter evicted - does not grow with
        the rows; scaled up, an 8-row step was predicted 5 ms above its cost and never
        verified). Steps beyond the last point by more than a quarter are not used."""
        xs = self.rows
        if len(self.observed) != len(xs):
            self.observed = [0.0] * len(xs)
        if rows > xs[-1] * 1.25:
            return
        i = bisect.bisect_left(xs, rows)
        if i == 0 or i == len(xs):
            parts = [(min(i, len(xs) - 1), 1.0)]
        else:
            f = (rows - xs[i - 1]) / (xs[i] - xs[i - 1])
            parts = [(i - 1, 1.0 - f), (i, f)]
        pred = sum(w * self.seconds[j] for j, w in parts)
        if pred <= 0:
            return
        seconds = min(max(seconds, 0.5 * pred), 2.0 * pred)  # one stalled step moves it little
        delta = self.smoothing * (seconds - pred)
        for j, w in parts:
            self.seconds[j] += w * delta
            self.observed[j] += w
        self._follow()

    def _follow(self) -> None:
        """Points never observed: the calibration's reading moved by the observed points' mean
        change since calibration (weighted by observations), down as a factor, up as seconds
        (see :meth:`observe`). From the calibration each time, never step by step: following
        every step's noise, down by factors and up by seconds, drifted the large points to
        half their cost."""
        obs = [(w, y, b) for w, y, b in zip(self.observed, self.seconds, self.base, strict=True)
               if w > 0]  # fmt: skip
        total, was = sum(w for w, _, _ in obs), sum(w * b for w, _, b in obs)
        if total <= 0 or was <= 0:
            return
        now = sum(w * y for w, y, _ in obs)
        ratio, delta = now / was, (now - was) / total
        for j, w in enumerate(self.observed):
            if w == 0:
                b = self.base[j]
                self.seconds[j] = b * ratio if ratio < 1 else b + delta


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
) -> tuple[Choice, list[int]]:
    """Packed verify (rows = B + nodes): the ``n`` nodes of highest gain over the whole batch
    maximizing ``(B + their gains) / (curve(B + n) + draft_s if n > 0)``; the choice and the
    nodes it gives each sequence.

    >>> curve = CostCurve([1, 4, 8], [0.010, 0.011, 0.020])
    >>> choose_packed([[0.9, 0.2], [0.8, 0.1]], curve, draft_s=0.0)[1]
    [1, 1]
    """
    b = len(gains)
    items = sorted(((g, i) for i, gs in enumerate(gains) for g in gs), reverse=True)
    if max_nodes is not None:
        items = items[:max_nodes]
    best, best_n = Choice(0, curve(b), float(b)), 0
    acc = 0.0
    for n, (g, _) in enumerate(items, start=1):
        acc += g
        c = Choice(n, curve(b + n) + draft_s, b + acc)
        if c.goodput > best.goodput:
            best, best_n = c, n
    counts = [0] * b
    for _, i in items[:best_n]:
        counts[i] += 1
    return best, counts


@dataclass
class Selector:
    """Per-engine state of the goodput budget: the curve, the acceptance statistics, the last
    choice (hysteresis) and the drafting time per step."""

    curve: CostCurve
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    hysteresis: float = 0.05
    """A new width replaces the last one only if its predicted goodput is this much higher."""
    probe_every: int = 8
    """While plain decoding wins, still draft every this many steps to keep the estimates
    fresh (the drafter sees every committed token either way)."""
    max_probe_gap: int = 64
    """A probe that still chooses plain decoding doubles the gap to the next one, up to this
    many steps (a probe drafts for every sequence: at a large batch, where a node rarely pays,
    probing every ``probe_every`` steps costs more than it finds); choosing nodes resets it."""
    probe_gap: int = 0
    """Steps between probes now (0: ``probe_every``)."""
    draft_s: float = 0.0
    """Moving average of drafting seconds per drafting sequence (a step's drafting costs this
    times the sequences that draft)."""
    probe_sequences: int = 4
    """A probe (a draft while plain decoding wins) asks at most this many sequences of a batch,
    in turn: each drafter proposing also catches up on the target states of the steps it
    skipped, and a large batch paid that for every sequence at every probe. Their gains decide;
    once nodes are chosen again, every sequence drafts."""
    last: Choice | None = None
    idle: int = 0
    """Steps since the selector last drafted."""
    curve_source: str = "measured"
    """Where the curve came from (:attr:`specpilot.goodput.curve.MeasuredCurve.source`)."""
    log: list[tuple[int, int, float, float]] = field(default_factory=list)
    """(batch, rows, predicted verify s, actual verify s) of the last steps (metrics,
    reports)."""
    steps: int = 0
    plain_steps: int = 0
    """Steps verified without draft nodes."""

    def __post_init__(self) -> None:
        if not 0 <= self.hysteresis < 1:
            raise ConfigError(f"goodput hysteresis must be in [0, 1), got {self.hysteresis}")
        if self.probe_every < 1:
            raise ConfigError(f"goodput probe_every must be >= 1, got {self.probe_every}")

    recent: list[list[float]] = field(default_factory=list)
    """The calibrated gains of the trees drafted lately (up to ``recent_trees``, the best
    ``probe_sequences`` of a step): the best case :meth:`could_pay` judges by."""
    recent_trees: int = 16
    max_bound_skips: int = 2
    """Probes in a row :meth:`could_pay` may skip (then one runs anyway: the trees it judges
    by are only refreshed by drafting, and a new context may suit the drafter again)."""
    bound_skips: int = 0
    cheap_draft: float = 0.03
    """Drafting that costs at most this fraction of a plain step (all drafting sequences
    together) runs every step, for every sequence, even while plain decoding wins: probing by
    backoff saves next to nothing there and misses the start of a copy run (a suffix drafter
    drafts in ~0.1 ms against an 8 ms step)."""
    _every: bool = False

    def cheap(self, batch: int = 1) -> bool:
        """Whether drafting for ``batch`` sequences is cheap enough to run every step
        (:attr:`cheap_draft`; False while its cost is unmeasured)."""
        return 0 < self.draft_s * batch <= self.cheap_draft * self.curve(batch)

    def should_draft(self, batch: int = 1) -> bool:
        """Whether to run the drafter this step for a batch of ``batch`` sequences (False while
        plain decoding wins, except for a probe every ``probe_every`` steps, backing off; a
        probe that even the best case seen lately says cannot pay is skipped, at most
        ``max_bound_skips`` in a row, and backs off like one that chose plain decoding: see
        :meth:`could_pay`; a new sequence starts the backoff afresh, :meth:`begin_sequence`).
        Cheap drafting (:meth:`cheap`) always runs."""
        gap = self.probe_gap or self.probe_every
        self._every = self.cheap(batch)
        if self.last is None or self.last.width > 0 or self._every:
            return True
        if self.idle + 1 < gap:
            return False
        if self.bound_skips < self.max_bound_skips and not self.could_pay(batch):
            self.bound_skips += 1
            self.idle = -1  # the caller's note_skip makes it 0: counted as after a probe
            self._next_probe(0)
            return False
        self.bound_skips = 0
        return True

    def begin_sequence(self) -> None:
        """A new context (a single sequence, or the first of a batch that was empty): its first
        step drafts (a fresh prompt may suit the drafter, whatever the last one did) and the
        probes' backoff starts afresh."""
        self.idle, self.probe_gap, self.bound_skips, self.last = 0, 0, 0, None

    def could_pay(self, batch: int = 1) -> bool:
        """Whether a probe of ``batch`` sequences could choose nodes in the best case seen
        lately: each sequence a probe asks (``probe_sequences``) proposing the tree of highest
        expected acceptance among the last ``recent_trees`` drafted (their calibrated gains), at
        the measured drafting cost. At a large batch a drafted sequence's extra
        tokens rarely buy its drafting time, and a probe there was pure cost. True while nothing
        is known (no drafting time or acceptance measured yet)."""
        if self.draft_s <= 0 or not self.recent:
            return True
        k = min(batch, max(1, self.probe_sequences))
        best = max(self.recent, key=sum)  # gains as calibrated when drafted
        gains = [best] * k + [[] for _ in range(batch - k)]
        if batch > 1:
            return choose_packed(gains, self.curve, self.draft_s * k)[0].width > 0
        return choose(gains, self.curve, self.draft_s).width > 0

    def _next_probe(self, width: int) -> None:
        """Back off after a probe that chose plain decoding; reset once nodes are chosen."""
        if width > 0:
            self.probe_gap = self.probe_every
        elif self.last is not None and self.last.width == 0:
            gap = self.probe_gap or self.probe_every
            self.probe_gap = min(max(self.max_probe_gap, self.probe_every), 2 * gap)

    def select(self, trees: Sequence[DraftTree], packed: bool = False,
               drafted: int | None = None,
               regimes: Sequence[int] | None = None) -> list[DraftTree]:  # fmt: skip
        """Cut every tree to this step's budget (all empty for plain decoding); ``packed``: the
        verify costs the rows the trees have (:func:`choose_packed`), else B x the widest.
        ``drafted``: sequences whose drafter ran (default: all; a probe asks fewer);
        ``regimes``: each sequence's (:func:`next_regime`; default 0)."""
        regimes = regimes if regimes is not None else [0] * len(trees)
        gains = [node_gains(t, self.stats, r) for t, r in zip(trees, regimes, strict=True)]
        drafted_gains = sorted((g for g in gains if g), key=sum, reverse=True)
        self.recent = [*self.recent, *drafted_gains[: self.probe_sequences]][-self.recent_trees :]
        draft_s = self.draft_s * (len(trees) if drafted is None else drafted)
        if packed and len(trees) > 1:
            return self._select_packed(trees, gains, draft_s)
        new = choose(gains, self.curve, draft_s)
        if self.last is not None and self.last.width != new.width:
            keep = self.last.width
            if keep <= max((t.size for t in trees), default=0):
                old = choose(gains, self.curve, draft_s, max_width=keep)
                if new.goodput <= old.goodput * (1 + self.hysteresis):
                    new = old
        self._next_probe(new.width)
        self.last = new
        out = []
        for t, g in zip(trees, gains, strict=True):
            keep = best_nodes(t, g, new.width)
            out.append(t if len(keep) == t.size else subtree(t, keep))
        return out

    def _select_packed(
        self, trees: Sequence[DraftTree], gains: list[list[float]], draft_s: float
    ) -> list[DraftTree]:
        new, counts = choose_packed(gains, self.curve, draft_s)
        if self.last is not None and self.last.width != new.width:
            old, old_counts = choose_packed(gains, self.curve, draft_s, self.last.width)
            if new.goodput <= old.goodput * (1 + self.hysteresis):
                new, counts = old, old_counts
        self._next_probe(new.width)
        self.last = new
        out = []
        for t, g, k in zip(trees, gains, counts, strict=True):
            keep = best_nodes(t, g, k)
            out.append(t if len(keep) == t.size else subtree(t, keep))
        return out

    @property
    def probing(self) -> bool:
        """This draft is a probe: the last choice was plain decoding, and drafting is not
        cheap enough to run for every sequence (:meth:`cheap`)."""
        return self.last is not None and self.last.width == 0 and not self._every

    def note_draft(self, seconds: float, sequences: int = 1) -> None:
        """``seconds`` of drafting by ``sequences`` drafters this step."""
        self.idle = 0
        per = seconds / max(1, sequences)
        self.draft_s = per if self.draft_s == 0 else 0.8 * self.draft_s + 0.2 * per

    def note_skip(self) -> None:
        self.idle += 1

    def observe(
        self,
        trees: Sequence[DraftTree],
        paths: Sequence[Sequence[int]],
        verify_s: float,
        packed: bool = False,
        regimes: Sequence[int] | None = None,
    ) -> None:
        """After a step: acceptance statistics (each tree in the regime it was selected in) and
        the curve at the step's rows."""
        regimes = regimes if regimes is not None else [0] * len(trees)
        for t, p, r in zip(trees, paths, regimes, strict=True):
            self.stats.observe(t, p, r)
        width = max((t.size for t in trees), default=0)
        rows = len(trees) + sum(t.size for t in trees) if packed else len(trees) * (1 + width)
        self.log.append((len(trees), rows, self.curve(rows), verify_s))
        del self.log[:-256]
        self.steps += 1
        self.plain_steps += width == 0
        self.curve.observe(rows, verify_s)

    def summary(self) -> dict[str, Any]:
        """Steps, plain steps, mean predicted and measured verify time of the logged steps, the
        curve and whether it was measured or cached (what ``bench`` and ``/metrics`` show)."""
        n = max(len(self.log), 1)
        return {
            "steps": self.steps,
            "plain_steps": self.plain_steps,
            "predicted_ms": 1e3 * sum(e[2] for e in self.log) / n,
            "actual_ms": 1e3 * sum(e[3] for e in self.log) / n,
            "mean_rows": sum(e[1] for e in self.log) / n,
            "curve": {"rows": list(self.curve.rows), "seconds": list(self.curve.seconds)},
            "curve_source": self.curve_source,
        }


CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 8, 11, 16, 24, 32, 48, 64)
"""Row counts a curve is measured at: every one up to 6 (a verify kernel's cost steps with its
row tiles there: 3 and 4 rows cost alike on one machine, 5 a third more, which powers of two
alone interpolated away), then sparser."""


def calibration_shape(slots: int, max_rows: int = 64) -> tuple[int, tuple[int, ...]]:
    """(context length, row counts) for measuring a curve in a cache of ``slots`` slots: up to
    128 cached tokens and the :data:`CALIBRATION_ROWS` up to ``max_rows``, fewer in a small
    cache.

    >>> calibration_shape(1024)
    (128, (1, 2, 3, 4, 5, 6, 8, 11, 16, 24, 32, 48, 64))
    >>> calibration_shape(40)
    (19, (1, 2, 3, 4, 5, 6, 8, 11, 16))
    >>> calibration_shape(1024, max_rows=16)
    (128, (1, 2, 3, 4, 5, 6, 8, 11, 16))
    """
    width = max(1, min(max_rows, 64, (slots - 2) // 2))
    rows = tuple(r for r in CALIBRATION_ROWS if r <= width)
    return min(128, slots - width - 2), rows


def calibrate_curve(
    step: Callable[[int], None],
    rows: Sequence[int] = CALIBRATION_ROWS,
    repeats: int = 3,
) -> CostCurve:
    """Time ``step(r)`` (one verify forward of ``r`` rows, finished when it returns) at each
    row count: after one warm-up pass, ``repeats`` passes over all the row counts, best per
    count (the least disturbed reading). Passes, not repeats per count in a row: a disturbed
    second of a shared machine then slows one reading of every count instead of all readings of
    one, which made a 2-row step look 1.8x a plain one and the budget never draft. The verify
    forwards themselves: :func:`specpilot.goodput.curve.measure_verify_curve`."""
    for r in rows:
        step(r)
    best = [math.inf] * len(rows)
    for _ in range(repeats):
        for i, r in enumerate(rows):
            t = time.perf_counter()
            step(r)
            best[i] = min(best[i], time.perf_counter() - t)
    return CostCurve(list(rows), best)
