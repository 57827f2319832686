"""The goodput budget's cost curve: verify step seconds by rows in the target forward, measured
(:func:`calibrate_curve`, the row counts :data:`CALIBRATION_ROWS`) and refreshed online from
observed steps (:meth:`CostCurve.observe`). The verify forwards it times and the on-disk cache:
:mod:`specpilot.goodput.curve`."""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specpilot.errors import ConfigError

__all__ = ["CALIBRATION_ROWS", "CostCurve", "calibrate_curve", "calibration_shape"]


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
        ys = self._levels
        if ys is None:  # more rows never cost less; kept until observe moves a point
            ys = self._levels = list(itertools.accumulate(self.seconds, max))
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
    stale_after: int = 64
    """Observations after which a point not observed since follows the level like a point never
    observed (:meth:`_follow`)."""
    seen: list[int] = field(default_factory=list)
    """The observation count at each point's last observation (0: never)."""
    count: int = 0
    """Observations so far."""
    _levels: list[float] | None = field(default=None, init=False, repr=False, compare=False)
    """The non-decreasing curve through :attr:`seconds` (None: to compute; a step's choice
    reads the curve ~10-100 times)."""

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
        if len(self.seen) != len(xs):
            self.seen = [0] * len(xs)
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
        self._levels = None
        delta = self.smoothing * (seconds - pred)
        self.count += 1
        for j, w in parts:
            self.seconds[j] += w * delta
            self.observed[j] += w
            if w > 0:
                self.seen[j] = self.count
        self._follow()

    def _follow(self) -> None:
        """Points not observed lately (never, or not in the last :attr:`stale_after`
        observations): the calibration's reading moved by the fresh points' mean change since
        calibration (weighted by observations), down as a factor, up as seconds (see
        :meth:`observe`). From the calibration each time, never step by step: following every
        step's noise, down by factors and up by seconds, drifted the large points to half their
        cost. A point the selector stopped choosing kept whatever its last steps left: 2 rows
        held 7.0 ms for 600 steps of a HumanEval run whose 2-row steps had taken 6.0, and, the
        curve being non-decreasing, held 3 rows there too while they took 5.6-6.4
        (``bench/curve_trace.py``, BENCHMARKS.md)."""
        fresh = [self.count - t <= self.stale_after and w > 0
                 for t, w in zip(self.seen, self.observed, strict=True)]  # fmt: skip
        obs = [(w, y, b) for w, y, b, f
               in zip(self.observed, self.seconds, self.base, fresh, strict=True) if f]  # fmt: skip
        total, was = sum(w for w, _, _ in obs), sum(w * b for w, _, b in obs)
        if total <= 0 or was <= 0:
            return
        now = sum(w * y for w, y, _ in obs)
        ratio, delta = now / was, (now - was) / total
        for j, f in enumerate(fresh):
            if not f:
                b = self.base[j]
                self.seconds[j] = b * ratio if ratio < 1 else b + delta


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
