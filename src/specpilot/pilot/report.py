"""``DIR/report.html``: one self-contained page per run (inline SVG, no JavaScript, no assets),
rendered from the jinja2 template ``templates/report.html.j2`` (autoescaped).

Plots: the cost model's factors per round (grouped bars, gap as a label), the speedup per round
(every PASS candidate as a dot, kept changes ringed, the cumulative product of kept changes as a
line), and the tau histogram of the final plan (child-reported accepted lengths per step, display
only). Tables: each round's direction, candidates, statuses, reasons and ceiling flags. This
module computes the geometry; the template lays it out.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2

from specpilot.pilot.config import plan_hash
from specpilot.pilot.records import PlanJSON, ProfileRecord, RoundSummary, RunRecord, TrialRecord
from specpilot.plan import Plan

COLORS = {"tau": "#4c78a8", "kernel": "#e45756", "overhead": "#54a24b"}
STATUS_COLORS = {"PASS": "#2a7", "MISMATCH": "#d33", "TIMEOUT": "#e90", "CRASH": "#a3a",
                 "INTERRUPTED": "#888"}  # fmt: skip


@functools.cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("specpilot.pilot", "templates"),
        autoescape=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
    )  # fmt: skip
    return env.get_template("report.html.j2")


def factors_plot(profiles: Sequence[ProfileRecord], width: int = 680) -> dict[str, Any] | None:
    rows = [p for p in profiles if p.factors]
    if not rows:
        return None
    h, ml, mb, mt = 260, 50, 40, 30
    top = max(max((p.factors or {}).values()) for p in rows) * 1.1
    group = (width - ml - 20) / len(rows)
    bw = min(28.0, group / 4)
    scale = (h - mb - mt) / top
    bars, groups = [], []
    for i, p in enumerate(rows):
        f = p.factors or {}
        x0 = ml + i * group + group / 2 - 1.5 * bw
        for j, name in enumerate(COLORS):
            bh = f[name] * scale
            bars.append({"x": x0 + j * bw, "y": h - mb - bh, "w": bw - 2, "h": bh,
                         "color": COLORS[name], "name": name, "v": f[name]})  # fmt: skip
        groups.append({"x": ml + i * group + group / 2, "round": p.round,
                       "gap": f["tau"] * f["kernel"] * f["overhead"]})  # fmt: skip
    ticks = [{"v": top * k / 4, "y": h - mb - top * k / 4 * scale} for k in range(5)]
    return {"width": width, "h": h, "ml": ml, "base": h - mb, "legend": list(COLORS.items()),
            "ticks": ticks, "bars": bars, "groups": groups}  # fmt: skip


def speedups_plot(rounds: Sequence[RoundSummary], width: int = 680) -> dict[str, Any] | None:
    if not rounds:
        return None
    h, ml, mb, mt = 260, 50, 30, 20
    pts: list[tuple[int, float, bool]] = []
    cum, line = 1.0, []
    for r in rounds:
        pts += [(r.round, c.speedup, False) for c in r.candidates
                if c.status == "PASS" and c.speedup]  # fmt: skip
        for k in r.kept:
            pts.append((r.round, k.speedup, True))
            cum *= k.speedup
        line.append((r.round, cum))
    vals = [v for _, v, _ in pts] + [v for _, v in line] + [1.0]
    lo, hi = min(vals) * 0.95, max(vals) * 1.05
    n = max(len(rounds), 1)

    def px(rnd: int) -> float:
        return ml + (rnd + 0.5) / n * (width - ml - 20)

    def py(v: float) -> float:
        return h - mb - (v - lo) / (hi - lo) * (h - mb - mt)

    ticks = [{"v": lo + (hi - lo) * k / 4, "y": py(lo + (hi - lo) * k / 4)} for k in range(5)]
    return {
        "width": width, "h": h, "ml": ml, "one": py(1.0), "ticks": ticks,
        "rounds": [{"x": px(r.round), "round": r.round} for r in rounds],
        "points": [{"x": px(rnd), "y": py(v), "kept": kept} for rnd, v, kept in pts],
        "line": " ".join(f"{px(r):.1f},{py(v):.1f}" for r, v in line),
    }  # fmt: skip


def tau_hist(trials: Sequence[TrialRecord], plan: Mapping[str, Any]) -> list[int]:
    """Accepted-length histogram of ``plan`` from the latest trial that timed it."""
    want = plan_hash(plan)
    for t in reversed(trials):
        res = t.result
        if res.plan and plan_hash(res.plan) == want and res.accept_hist:
            return list(res.accept_hist)
        if t.base == want and res.base_accept_hist:
            return list(res.base_accept_hist)
    return []


def hist_plot(hist: Sequence[int], width: int = 680) -> dict[str, Any] | None:
    if not hist or sum(hist) == 0:
        return None
    h, ml, mb, mt = 220, 50, 34, 20
    top = max(hist)
    bw = (width - ml - 20) / len(hist)
    bars = []
    for i, c in enumerate(hist):
        bh = c / top * (h - mb - mt)
        x = ml + i * bw
        bars.append({"x": x, "y": h - mb - bh, "w": max(bw - 2, 1), "h": bh, "count": c,
                     "cx": x + bw / 2})  # fmt: skip
    total = sum(hist)
    mean = sum(i * c for i, c in enumerate(hist)) / total
    return {"width": width, "h": h, "base": h - mb, "bars": bars, "total": total,
            "tau": mean + 1}  # fmt: skip


def _round_view(r: RoundSummary) -> dict[str, Any]:
    rows = []
    for c in r.candidates:
        sp = f"{c.speedup:.3f} ± {c.spread or 0:.3f}" if c.speedup else "-"
        rows.append({"mechanism": c.item.mechanism, "params": json.dumps(c.item.params),
                     "source": c.item.source, "status": c.status, "speedup": sp,
                     "color": STATUS_COLORS.get(c.status, "#000"),
                     "reason": str(c.reason or "")[:200]})  # fmt: skip
    agent = [f"agent {e.get('agent', '-')} ({e.get('direction', '')}): {e.get('status')} at "
             f"{e.get('stage')}: {e.get('reason') or e.get('mechanism') or ''}"[:400]
             for e in r.agent or []]  # fmt: skip
    flags = [f"{f.mechanism}: {f.speedup:.3f}x reported, ceiling {f.ceiling:.3f}x; re-measured "
             + (f"{f.remeasured:.3f}x" if f.remeasured is not None else "not")
             + (" (cleared)" if f.cleared else "") for f in r.flags]  # fmt: skip
    return {
        "round": r.round, "directions": r.directions,
        "factors": ", ".join(f"{k} {v:.3f}" for k, v in r.factors.items()),
        "kept": ", ".join(f"{k.mechanism} ({k.speedup:.3f}x)" for k in r.kept),
        "rows": rows, "agent": agent, "sandbox": str(r.sandbox), "flags": flags,
    }  # fmt: skip


def render(run: RunRecord, profiles: Sequence[ProfileRecord], rounds: Sequence[RoundSummary],
           trials: Sequence[TrialRecord], plan: PlanJSON) -> str:  # fmt: skip
    cfg = run.config
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.result.status] = counts.get(t.result.status, 0) + 1
    return _template().render(
        title=f"specpilot optimize: run {run.run_id}", model=str(cfg.get("model")),
        budget=cfg.get("budget_minutes"), n_rounds=len(rounds), n_trials=len(trials),
        statuses=", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none",
        sandbox=next((r.sandbox for r in rounds if r.sandbox), None),
        factors=factors_plot(profiles), speedups=speedups_plot(rounds),
        hist=hist_plot(tau_hist(trials, plan)),
        plan=json.dumps(plan, indent=2, sort_keys=True),
        rounds=[_round_view(r) for r in rounds],
    )  # fmt: skip


def write_report(path: Path, run: RunRecord, profiles: Sequence[ProfileRecord],
                 rounds: Sequence[RoundSummary], trials: Sequence[TrialRecord],
                 plan: PlanJSON) -> None:  # fmt: skip
    """Write the page atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render(run, profiles, rounds, trials, plan))
    os.replace(tmp, path)


def describe_plan(plan_json: Mapping[str, Any]) -> str:
    """``Plan.describe`` plus the mechanisms applied (engine-only changes show there)."""
    p = Plan.from_json(plan_json)
    mechs = ", ".join(f"{m.id} {dict(m.params)}" for m in p.mechanisms)
    return p.describe() + (f" + {mechs}" if mechs else "")
