"""``DIR/report.html``: one self-contained page per run (inline SVG, no JavaScript, no assets).

Plots: the cost model's factors per round (grouped bars, gap as a label), the speedup per round
(every PASS candidate as a dot, kept changes ringed, the cumulative product of kept changes as a
line), and the tau histogram of the final plan (child-reported accepted lengths per step, display
only). Tables: each round's direction, candidates, statuses and reasons.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specpilot.plan import Plan

COLORS = {"tau": "#4c78a8", "kernel": "#e45756", "overhead": "#54a24b"}
STATUS_COLORS = {"PASS": "#2a7", "MISMATCH": "#d33", "TIMEOUT": "#e90", "CRASH": "#a3a"}


def _h(plan: Mapping[str, Any]) -> str:
    blob = json.dumps(plan, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _svg_open(w: int, h: int) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        'font-family="sans-serif" font-size="12">'
    )


def svg_factors(profiles: Sequence[Mapping[str, Any]], width: int = 680) -> str:
    rows = [p for p in profiles if p.get("factors")]
    if not rows:
        return "<p>No cost-model profile finished.</p>"
    h, ml, mb, mt = 260, 50, 40, 30
    top = max(max(p["factors"].values()) for p in rows) * 1.1
    group = (width - ml - 20) / len(rows)
    bw = min(28.0, group / 4)
    parts = [_svg_open(width, h)]
    parts.append(f'<line x1="{ml}" y1="{h - mb}" x2="{width - 10}" y2="{h - mb}" stroke="#000"/>')
    for i, name in enumerate(COLORS):
        parts.append(f'<text x="{ml + 90 * i}" y="14" fill="{COLORS[name]}">{name}</text>')
    for k in range(5):
        v = top * k / 4
        y = h - mb - v / top * (h - mb - mt)
        parts.append(f'<text x="{ml - 4}" y="{y + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for i, p in enumerate(rows):
        x0 = ml + i * group + group / 2 - 1.5 * bw
        for j, name in enumerate(COLORS):
            v = p["factors"][name]
            bh = v / top * (h - mb - mt)
            parts.append(
                f'<rect x="{x0 + j * bw:.1f}" y="{h - mb - bh:.1f}" width="{bw - 2:.1f}" '
                f'height="{bh:.1f}" fill="{COLORS[name]}"><title>{name} {v:.3f}</title></rect>'
            )
        gap = p["factors"]["tau"] * p["factors"]["kernel"] * p["factors"]["overhead"]
        cx = ml + i * group + group / 2
        parts.append(
            f'<text x="{cx:.1f}" y="{h - mb + 14}" text-anchor="middle">round {p["round"]}</text>'
            f'<text x="{cx:.1f}" y="{h - mb + 28}" text-anchor="middle">gap {gap:.2f}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def svg_speedups(rounds: Sequence[Mapping[str, Any]], width: int = 680) -> str:
    if not rounds:
        return "<p>No round finished.</p>"
    h, ml, mb, mt = 260, 50, 30, 20
    pts: list[tuple[int, float, bool]] = []
    cum, line = 1.0, []
    for r in rounds:
        for c in r.get("candidates", []):
            if c.get("status") == "PASS" and c.get("speedup"):
                pts.append((r["round"], c["speedup"], False))
        for k in r.get("kept", []):
            pts.append((r["round"], k["speedup"], True))
            cum *= k["speedup"]
        line.append((r["round"], cum))
    vals = [v for _, v, _ in pts] + [v for _, v in line] + [1.0]
    lo, hi = min(vals) * 0.95, max(vals) * 1.05
    n = max(len(rounds), 1)

    def px(rnd: int) -> float:
        return ml + (rnd + 0.5) / n * (width - ml - 20)

    def py(v: float) -> float:
        return h - mb - (v - lo) / (hi - lo) * (h - mb - mt)

    parts = [_svg_open(width, h)]
    parts.append(f'<line x1="{ml}" y1="{py(1.0):.1f}" x2="{width - 10}" y2="{py(1.0):.1f}" '
                 'stroke="#aaa" stroke-dasharray="4 3"/>')  # fmt: skip
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        parts.append(f'<text x="{ml - 4}" y="{py(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
    for r in rounds:
        parts.append(f'<text x="{px(r["round"]):.1f}" y="{h - 8}" text-anchor="middle">'
                     f'round {r["round"]}</text>')  # fmt: skip
    for rnd, v, kept in pts:
        style = (
            'fill="none" stroke="#000" stroke-width="2" r="7"' if kept else 'fill="#4c78a8" r="4"'
        )
        parts.append(f'<circle cx="{px(rnd):.1f}" cy="{py(v):.1f}" {style}/>')
    poly = " ".join(f"{px(r):.1f},{py(v):.1f}" for r, v in line)
    parts.append(f'<polyline points="{poly}" fill="none" stroke="#e45756" stroke-width="2"/>')
    parts.append(f'<text x="{ml}" y="12">dots: PASS candidates; rings: kept; '
                 '<tspan fill="#e45756">line: cumulative kept speedup</tspan></text>')  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def tau_hist(trials: Sequence[Mapping[str, Any]], plan: Mapping[str, Any]) -> list[int]:
    """Accepted-length histogram of ``plan`` from the latest trial that timed it."""
    want = _h(plan)
    for t in reversed(trials):
        res = t["result"]
        if res.get("plan") and _h(res["plan"]) == want and res.get("accept_hist"):
            return list(res["accept_hist"])
        if t.get("base") == want and res.get("base_accept_hist"):
            return list(res["base_accept_hist"])
    return []


def svg_hist(hist: Sequence[int], width: int = 680) -> str:
    if not hist or sum(hist) == 0:
        return "<p>No timed run of the final plan yet.</p>"
    h, ml, mb, mt = 220, 50, 34, 20
    top = max(hist)
    bw = (width - ml - 20) / len(hist)
    parts = [_svg_open(width, h)]
    for i, c in enumerate(hist):
        bh = c / top * (h - mb - mt)
        x = ml + i * bw
        parts.append(
            f'<rect x="{x:.1f}" y="{h - mb - bh:.1f}" width="{max(bw - 2, 1):.1f}" '
            f'height="{bh:.1f}" fill="#4c78a8"><title>{c} steps</title></rect>'
            f'<text x="{x + bw / 2:.1f}" y="{h - mb + 14}" text-anchor="middle">{i}</text>'
        )
    total = sum(hist)
    mean = sum(i * c for i, c in enumerate(hist)) / total
    parts.append(f'<text x="{width / 2}" y="{h - 4}" text-anchor="middle">accepted draft tokens '
                 f'per step ({total} steps; tau = {mean + 1:.2f})</text>')  # fmt: skip
    parts.append("</svg>")
    return "".join(parts)


def _round_table(r: Mapping[str, Any]) -> str:
    rows = []
    for c in r.get("candidates", []):
        st = c.get("status", "")
        sp = f"{c['speedup']:.3f} &plusmn; {c.get('spread') or 0:.3f}" if c.get("speedup") else "-"
        rows.append(
            f"<tr><td>{html.escape(c['mechanism'])}</td>"
            f"<td><code>{html.escape(json.dumps(c.get('params', {})))}</code></td>"
            f"<td>{html.escape(c.get('source', ''))}</td>"
            f'<td style="color:{STATUS_COLORS.get(st, "#000")}">{st}</td><td>{sp}</td>'
            f"<td>{html.escape(str(c.get('reason') or ''))[:200]}</td></tr>"
        )
    kept = ", ".join(f"{k['mechanism']} ({k['speedup']:.3f}x)" for k in r.get("kept", []))
    agent = "".join(
        "<li>" + html.escape(f"agent {e.get('agent', '-')} ({e.get('direction', '')}): "
                             f"{e.get('status')} at {e.get('stage')}: "
                             f"{e.get('reason') or e.get('mechanism') or ''}"[:400]) + "</li>"
        for e in r.get("agent", [])
    )  # fmt: skip
    if agent:
        agent = f"<p>Agents (sandbox: {html.escape(str(r.get('sandbox')))}):</p><ul>{agent}</ul>"
    f = r.get("factors") or {}
    fac = ", ".join(f"{k} {v:.3f}" for k, v in f.items())
    return (
        f"<h3>Round {r['round']}: direction {', '.join(r.get('directions', [])) or '-'}</h3>"
        f"<p>factors: {fac or 'n/a'}; kept: {html.escape(kept) or 'nothing'}</p>"
        "<table><tr><th>mechanism</th><th>params</th><th>from</th><th>status</th>"
        "<th>speedup</th><th>reason</th></tr>" + "".join(rows) + "</table>" + agent
    )


def render(
    run: Mapping[str, Any],
    profiles: Sequence[Mapping[str, Any]],
    rounds: Sequence[Mapping[str, Any]],
    trials: Sequence[Mapping[str, Any]],
    plan: Mapping[str, Any],
) -> str:
    cfg = run.get("config", {})
    counts: dict[str, int] = {}
    for t in trials:
        counts[t["result"]["status"]] = counts.get(t["result"]["status"], 0) + 1
    status = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
    title = f"specpilot optimize: run {run.get('run_id', '?')}"
    box = next((r["sandbox"] for r in rounds if r.get("sandbox")), None)
    sandbox = (
        f"<p>Agent-written code ran only in sandboxed trial processes: <b>{html.escape(box)}</b> "
        "(docs/agent.md lists what each level enforces).</p>"
        if box
        else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:900px;margin:2em auto}}
table{{border-collapse:collapse;font-size:13px}}td,th{{border:1px solid #ccc;padding:2px 6px}}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>model <b>{html.escape(str(cfg.get("model")))}</b>, budget {cfg.get("budget_minutes")} min,
{len(rounds)} round(s), {len(trials)} trial(s): {status}.
Speedups are the loop's own paired measurements (baseline / candidate wall time, median over
rounds &plusmn; half range); an independent <code>specpilot bench --plan</code> run is the
figure to quote.</p>
{sandbox}
<h2>Cost-model factors per round</h2>
{svg_factors(profiles)}
<h2>Speedup per round</h2>
{svg_speedups(rounds)}
<h2>Tau histogram of the final plan</h2>
{svg_hist(tau_hist(trials, plan))}
<h2>Final plan</h2>
<pre>{html.escape(json.dumps(plan, indent=2, sort_keys=True))}</pre>
<h2>Rounds</h2>
{"".join(_round_table(r) for r in rounds)}
</body></html>
"""


def write_report(
    path: Path,
    run: Mapping[str, Any],
    profiles: Sequence[Mapping[str, Any]],
    rounds: Sequence[Mapping[str, Any]],
    trials: Sequence[Mapping[str, Any]],
    plan: Mapping[str, Any],
) -> None:
    """Write the page atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render(run, profiles, rounds, trials, plan))
    os.replace(tmp, path)


def describe_plan(plan_json: Mapping[str, Any]) -> str:
    """``Plan.describe`` plus the mechanisms applied (engine-only changes show there)."""
    p = Plan.from_json(plan_json)
    mechs = ", ".join(f"{m.id} {dict(m.params)}" for m in p.mechanisms)
    return p.describe() + (f" + {mechs}" if mechs else "")
