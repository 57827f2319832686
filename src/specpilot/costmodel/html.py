"""Self-contained HTML page of a cost report: factor table and two inline SVG plots.

Plot 1: floor vs measured time per kernel class (horizontal bars, ms per decode step).
Plot 2: tau_opt(N) and tau_bf(N) against the node budget N (log2 axis), N* marked.
No JavaScript and no external assets: the page is one string. The markup lives in jinja2
templates (``templates/report.html.j2``, ``kernels.svg.j2``, ``tau.svg.j2``, autoescaped); this
module only computes the plots' geometry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import jinja2

from specpilot.costmodel.report import CostReport

FLOOR_COLOR = "#4c78a8"
MEASURED_COLOR = "#e45756"
BF_COLOR = "#54a24b"
COLORS = {"floor": FLOOR_COLOR, "measured": MEASURED_COLOR, "bf": BF_COLOR}


@dataclass(frozen=True)
class Bar:
    y: int
    width: float
    value: float
    color: str


@dataclass(frozen=True)
class BarRow:
    name: str
    label_y: int
    bars: tuple[Bar, ...]


@dataclass(frozen=True)
class KernelPlot:
    width: int
    height: int
    left: int
    bar: int
    log: bool
    rows: tuple[BarRow, ...]


@dataclass(frozen=True)
class Tick:
    x: float = 0.0
    y: float = 0.0
    label: str = ""
    value: float = 0.0


@dataclass(frozen=True)
class Line:
    points: str
    color: str


@dataclass(frozen=True)
class TauPlot:
    width: int
    height: int
    left: int
    right: int
    top: int
    bottom: int
    x_ticks: tuple[Tick, ...]
    y_ticks: tuple[Tick, ...]
    lines: tuple[Line, ...]
    actual_y: float
    star_x: float | None
    n_star: int


def kernel_plot(report: CostReport, width: int = 640) -> KernelPlot:
    """Bars per class; a log scale when floors and measured times differ by more than 50x."""
    rows = [k for k in report.kernels if k.floor_ms > 0 or k.measured_ms > 0]
    left, bar, gap = 110, 10, 8
    vals = [v for k in rows for v in (k.floor_ms, k.measured_ms) if v > 0] or [1.0]
    hi, lo = max(vals), min(vals)
    log = hi / lo > 50
    span = width - left - 90
    lo_log = math.log10(lo) - 0.3  # the smallest bar keeps a visible length

    def length(v: float) -> float:
        if v <= 0:
            return 0.5
        if log:
            return max(0.5, (math.log10(v) - lo_log) / (math.log10(hi) - lo_log) * span)
        return max(0.5, v / hi * span)

    out, y = [], 26
    for k in rows:
        pair = ((k.floor_ms, FLOOR_COLOR), (k.measured_ms, MEASURED_COLOR))
        bars = tuple(Bar(y + i * bar, length(v), v, c) for i, (v, c) in enumerate(pair))
        out.append(BarRow(k.name, y + bar + 4, bars))
        y += 2 * bar + gap
    height = 40 + len(rows) * (2 * bar + gap)
    return KernelPlot(width, height, left, bar, log, tuple(out))


def tau_plot(report: CostReport, width: int = 640, height: int = 300) -> TauPlot | None:
    """tau_opt(N) and tau_bf(N) on a log2 N axis; None without a drafter (no budget above 0)."""
    pts = [b for b in report.budgets if b.n > 0]
    if not pts:
        return None
    ml, mr, mt, mb = 50, 20, 24, 40
    xs = [math.log2(b.n) for b in pts]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    ys = [b.tau_opt for b in pts] + [b.tau_bf for b in pts] + [1.0]
    y0, y1 = 1.0, max(max(ys), 1.5)

    def px(n: int) -> float:
        return ml + (math.log2(n) - x0) / (x1 - x0) * (width - ml - mr)

    def py(v: float) -> float:
        return height - mb - (v - y0) / (y1 - y0) * (height - mt - mb)

    y_values = [y0 + (y1 - y0) * i / 4 for i in range(5)]
    lines = tuple(
        Line(" ".join(f"{px(b.n):.1f},{py(getattr(b, attr)):.1f}" for b in pts), color)
        for attr, color in (("tau_opt", MEASURED_COLOR), ("tau_bf", BF_COLOR))
    )
    return TauPlot(
        width=width,
        height=height,
        left=ml,
        right=width - mr,
        top=mt,
        bottom=height - mb,
        x_ticks=tuple(Tick(x=px(b.n), label=str(b.n)) for b in pts),
        y_ticks=tuple(Tick(y=py(v), value=v) for v in y_values),
        lines=lines,
        actual_y=py(report.tau_actual),
        star_x=px(report.n_star) if report.n_star > 0 else None,
        n_star=report.n_star,
    )


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("specpilot.costmodel", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )


def to_html(report: CostReport, title: str = "specpilot profile") -> str:
    """The report as one self-contained HTML page."""
    page = _environment().get_template("report.html.j2")
    return page.render(
        r=report, title=title, kp=kernel_plot(report), tp=tau_plot(report), colors=COLORS
    )
