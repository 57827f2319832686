"""Self-contained HTML page of a cost report: factor table and two inline SVG plots.

Plot 1: floor vs measured time per kernel class (horizontal bars, ms per decode step).
Plot 2: tau_opt(N) and tau_bf(N) against the node budget N (log2 axis), N* marked.
No JavaScript and no external assets: the page is one string.
"""

from __future__ import annotations

import html
import math

from specpilot.costmodel.report import CostReport

FLOOR_COLOR = "#4c78a8"
MEASURED_COLOR = "#e45756"
BF_COLOR = "#54a24b"


def _svg_kernels(report: CostReport, width: int = 640) -> str:
    """Bars per class; a log scale when floors and measured times differ by more than 50x."""
    rows = [k for k in report.kernels if k.floor_ms > 0 or k.measured_ms > 0]
    left, bar, gap = 110, 10, 8
    height = 40 + len(rows) * (2 * bar + gap)
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

    scale = " (log scale)" if log else ""
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="{left}" y="14">ms per decode step{scale}: '
        f'<tspan fill="{FLOOR_COLOR}">floor</tspan> vs '
        f'<tspan fill="{MEASURED_COLOR}">measured</tspan></text>',
    ]
    y = 26
    for k in rows:
        name = html.escape(k.name)
        parts.append(f'<text x="{left - 6}" y="{y + bar + 4}" text-anchor="end">{name}</text>')
        for val, color in ((k.floor_ms, FLOOR_COLOR), (k.measured_ms, MEASURED_COLOR)):
            w = length(val)
            parts.append(
                f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar}" fill="{color}"/>'
                f'<text x="{left + w + 4:.1f}" y="{y + bar - 1}">{val:.3g}</text>'
            )
            y += bar
        y += gap
    parts.append("</svg>")
    return "".join(parts)


def _svg_tau(report: CostReport, width: int = 640, height: int = 300) -> str:
    pts = [b for b in report.budgets if b.n > 0]
    if not pts:
        return "<p>No drafter: tau = 1 at every budget.</p>"
    ml, mr, mt, mb = 50, 20, 24, 40
    xs = [math.log2(b.n) for b in pts]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    ys = [b.tau_opt for b in pts] + [b.tau_bf for b in pts] + [1.0]
    y0, y1 = 1.0, max(max(ys), 1.5)

    def px(v: float) -> float:
        return ml + (v - x0) / (x1 - x0) * (width - ml - mr)

    def py(v: float) -> float:
        return height - mb - (v - y0) / (y1 - y0) * (height - mt - mb)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<line x1="{ml}" y1="{height - mb}" x2="{width - mr}" y2="{height - mb}" stroke="#000"/>',
        f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{height - mb}" stroke="#000"/>',
        f'<text x="{width / 2}" y="{height - 6}" text-anchor="middle">node budget N</text>',
        f'<text x="{ml}" y="14"><tspan fill="{MEASURED_COLOR}">tau_opt(N)</tspan>, '
        f'<tspan fill="{BF_COLOR}">tau_bf(N)</tspan>, tau_actual dashed</text>',
    ]
    for b in pts:
        x = px(math.log2(b.n))
        parts.append(f'<text x="{x:.1f}" y="{height - mb + 14}" text-anchor="middle">{b.n}</text>')
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        parts.append(f'<text x="{ml - 4}" y="{py(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for attr, color in (("tau_opt", MEASURED_COLOR), ("tau_bf", BF_COLOR)):
        line = " ".join(f"{px(math.log2(b.n)):.1f},{py(getattr(b, attr)):.1f}" for b in pts)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
    ya = py(report.tau_actual)
    parts.append(
        f'<line x1="{ml}" y1="{ya:.1f}" x2="{width - mr}" y2="{ya:.1f}" stroke="#888" '
        'stroke-dasharray="4 3"/>'
    )
    if report.n_star > 0:
        xs_ = px(math.log2(report.n_star))
        parts.append(
            f'<line x1="{xs_:.1f}" y1="{mt}" x2="{xs_:.1f}" y2="{height - mb}" stroke="#aaa"/>'
            f'<text x="{xs_ + 4:.1f}" y="{mt + 12}">N* = {report.n_star}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def to_html(report: CostReport, title: str = "specpilot profile") -> str:
    """The report as one self-contained HTML page."""
    f = report.factors
    factor_rows = "".join(
        f"<tr><td>{name}</td><td>{value:.3f}</td></tr>" for name, value in f.items()
    )
    kernel_rows = "".join(
        f"<tr><td>{html.escape(k.name)}</td><td>{k.flops:.3g}</td><td>{k.bytes:.3g}</td>"
        f"<td>{k.floor_ms:.4f}</td><td>{k.measured_ms:.4f}</td></tr>"
        for k in report.kernels
    )
    stable = "stable" if report.direction_stable else "CHANGES"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:760px;margin:2em auto}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}
td:first-child{{text-align:left}}</style></head><body>
<h1>{html.escape(title)}</h1>
<p>drafter <b>{html.escape(report.drafter)}</b>, {report.n_prompts} prompts,
{report.decode_tokens} decode tokens in {report.steps} steps;
hardware {html.escape(report.hardware.name)} ({html.escape(report.hardware.source)}).</p>
<h2>Gap {report.gap:.2f} = tau x kernel x overhead; direction: {report.direction}</h2>
<table><tr><th>factor</th><th>value</th></tr>{factor_rows}</table>
<p>tau_actual {report.tau_actual:.3f}, N* = {report.n_star}; wall {report.wall_step_ms:.3f} ms
vs kernel {report.kernel_step_ms:.3f} ms per step; direction under alpha/beta +-20%: {stable}.
</p>
<h2>Kernel classes (per decode step)</h2>
{_svg_kernels(report)}
<table><tr><th>class</th><th>FLOPs</th><th>bytes</th><th>floor ms</th><th>measured ms</th></tr>
{kernel_rows}</table>
<h2>Exact replay: tau vs node budget</h2>
{_svg_tau(report)}
</body></html>
"""
