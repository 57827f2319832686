"""Batched speedup vs batch size: ``specpilot bench --batch-size N`` for several N, one model load.

    python bench/batch_sweep.py --sizes 1 2 4 8 16 --limit 32 --max-new-tokens 128 \\
        --out bench/results/batch_sweep -- --drafter suffix --threads 2

Flags after ``--`` are ``specpilot bench`` flags (model, drafter, tree, threads, workload).
Writes OUT.json (every run), OUT.md (a table) and OUT.svg (tok/s of batched AR and batched
speculative, and the speedup, against batch size). Each batch size's speculative outputs are
token-forced against batched AR at that size; a lossy size gets no speed figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specpilot.batch import BatchEngine
from specpilot.bench_batch import BatchBenchConfig, batch_config_for, plan_budget, run_batch_bench
from specpilot.cli import _setup, build_parser
from specpilot.workloads import load_workload


def _svg(rows: list[dict], width: int = 560, height: int = 320) -> str:
    """A small line plot: tok/s (AR, speculative) on the left axis, speedup on the right."""
    pad, sizes = 50, [r["batch_size"] for r in rows]
    top = max([r["ar_tok_s"] for r in rows] + [r["spec_tok_s"] or 0 for r in rows]) or 1.0
    top_sp = max([r["speedup"] or 0 for r in rows] + [1.0])

    def x(i: int) -> float:
        return pad + i * (width - 2 * pad) / max(len(rows) - 1, 1)

    def y(v: float, hi: float) -> float:
        return height - pad - v / hi * (height - 2 * pad)

    def line(vals: list[float | None], hi: float, color: str) -> str:
        pts = " ".join(f"{x(i):.1f},{y(v, hi):.1f}" for i, v in enumerate(vals) if v is not None)
        return f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>'

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        'stroke="black"/>',
        line([r["ar_tok_s"] for r in rows], top, "#888"),
        line([r["spec_tok_s"] for r in rows], top, "#1f77b4"),
        line([r["speedup"] for r in rows], top_sp, "#d62728"),
    ]
    for i, b in enumerate(sizes):
        parts.append(
            f'<text x="{x(i):.1f}" y="{height - pad + 15}" text-anchor="middle">{b}</text>'
        )
    parts += [
        f'<text x="{width / 2}" y="{height - 10}" text-anchor="middle">batch size</text>',
        f'<text x="{pad}" y="20">tok/s (max {top:.0f}): grey batched AR, blue speculative; '
        f"red speedup (max {top_sp:.2f}x)</text>",
        "</svg>",
    ]
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="bench/results/batch_sweep")
    args, rest = ap.parse_known_args()
    bench_args = build_parser().parse_args(["bench", *[a for a in rest if a != "--"]])
    prompts = load_workload(
        None if bench_args.prompts else (bench_args.workload or "humaneval"),
        prompts_file=bench_args.prompts,
        limit=args.limit,
    )
    loaded, engine, candidates, _ = _setup(bench_args)
    tok = loaded.tokenizer
    encoded = [(p.id, tok.encode_prompt(p.text, chat=p.chat)) for p in prompts]
    nodes = max((c.spec.max_nodes for c in candidates), default=0)
    runs, rows = [], []
    for n in args.sizes:
        cfg = BatchBenchConfig(n, args.max_new_tokens, args.repeats, not bench_args.ignore_eos)
        bcfg = batch_config_for(
            n,
            [p for _, p in encoded],
            args.max_new_tokens,
            nodes,
            plan_budget(bench_args.plan, nodes),
            bench_args.min_gain,
        )
        beng = BatchEngine(loaded.model, engine.cfg, bcfg, eos_ids=tok.eos_ids, detok=tok.decode)
        res = run_batch_bench(beng, encoded, candidates[:1], cfg)
        runs.append(res.to_json())
        c = res.candidates[0] if res.candidates else None
        rows.append(
            {
                "batch_size": n,
                "ar_tok_s": res.ar.tok_s,
                "spec_tok_s": c.tok_s if c else None,
                "speedup": res.speedup(c) if c else None,
                "tau": c.tau if c else 1.0,
                "lossless": res.lossless,
                "ar_p50_s": res.ar.latency_p50_s,
                "spec_p50_s": c.latency_p50_s if c else None,
                "ar_p99_s": res.ar.latency_p99_s,
                "spec_p99_s": c.latency_p99_s if c else None,
                "nodes_per_step": c.mean_draft_nodes if c else 0.0,
                "goodput": bool(engine.cfg.goodput),
            }
        )
        if beng.selector is not None:  # the budget's own account of the speculative run
            summary = beng.selector.summary()
            rows[-1]["selector"] = {k: v for k, v in summary.items() if k != "curve"}
        print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": loaded.source, "candidate": candidates[0].name if candidates else "none"}
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows, "runs": runs}, indent=2))
    lines = [
        "| batch | AR tok/s | spec tok/s | speedup | tau | nodes/step | lossless "
        "| AR p50 / p99 s | spec p50 / p99 s |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "n/a"
        spec = f"{r['spec_tok_s']:.1f}" if r["spec_tok_s"] else "n/a"
        lat = f"{r['spec_p50_s']:.2f} / {r['spec_p99_s']:.2f}" if r["spec_p50_s"] else "n/a"
        lines.append(
            f"| {r['batch_size']} | {r['ar_tok_s']:.1f} | {spec} | {sp} | {r['tau']:.2f} | "
            f"{r['nodes_per_step']:.1f} | {r['lossless']} | "
            f"{r['ar_p50_s']:.2f} / {r['ar_p99_s']:.2f} | {lat} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".svg").write_text(_svg(rows))
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
