"""``specpilot profile``: the Phase 0 cost model on the command line (renders; computes nothing).

Found by :mod:`specpilot.cli` like every ``cli_*`` module (``add_parser(sub)`` and
``run(args)``); also runnable alone: ``python -m specpilot.cli_profile [flags]``.
Model, drafter and workload flags are the ones ``bench`` takes; ``profile`` takes one drafter
and one tree shape (the plan to profile).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specpilot.cli import (
    _drafter_args,
    _model_args,
    _plan_args,
    _setup,
    _workload_args,
    note_chat_fallback,
    progress_bar,
    progress_console,
)
from specpilot.errors import ConfigError

DESCRIPTION = (
    "Split the gap to ideal of a plan (drafter + tree) into tau (exact replay vs the optimal "
    "best-first tree), kernel (profiled time vs roofline floors) and overhead (wall vs kernel "
    "time) factors; the largest is the next direction."
)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    _model_args(p)
    _drafter_args(p)
    _plan_args(p)
    _workload_args(p)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    g = p.add_argument_group("cost model")
    g.add_argument(
        "--max-budget", type=int, default=128, help="largest node budget N of the replay grid"
    )
    g.add_argument(
        "--replay-depth", type=int, default=32, help="depth of the replay's wide tree and chain"
    )
    g.add_argument("--alpha", type=float, default=0.60, help="share of peak FLOP/s in a floor")
    g.add_argument("--beta", type=float, default=0.90, help="share of peak bandwidth in a floor")
    g.add_argument(
        "--recalibrate", action="store_true", help="re-measure this machine's peaks (CPU)"
    )
    g.add_argument(
        "--compare-drafters",
        action="store_true",
        help="replay the other drafters this model offers too (lookup, suffix, a shipped head): "
        "the tau factor then compares against the best drafter's oracle",
    )
    p.add_argument("--json", default=None, help="write the report to this JSON file")
    p.add_argument("--html", default=None, help="write a self-contained HTML page with plots")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``profile`` subcommand to ``build_parser``'s subparsers."""
    p = subparsers.add_parser(
        "profile", help="cost model: tau, kernel and overhead factors", description=DESCRIPTION
    )
    _add_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Run a profile; 0 on success, 1 when the plan's output differs from the reference (the
    profile stops there and the forcing report is shown)."""

    from specpilot.costmodel import LossyPlanError, ProfileConfig, detect, profile
    from specpilot.costmodel.html import to_html
    from specpilot.runtime import alternative_drafters
    from specpilot.workloads import load_workload

    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    if len(set(args.drafter or [])) > 1 or len(set(args.tree or [])) > 1:
        raise ConfigError("profile takes one --drafter and one --tree (the plan to profile)")
    cfg = ProfileConfig(
        max_new_tokens=args.max_new_tokens,
        stop_on_eos=not args.ignore_eos,
        max_budget=args.max_budget,
        replay_depth=args.replay_depth,
        alpha=args.alpha,
        beta=args.beta,
    )
    from specpilot.outpaths import check_output_path

    for flag, path in (("--json", args.json), ("--html", args.html)):
        if path:
            check_output_path(path, flag)
    workload = None if args.prompts else (args.workload or "humaneval")
    prompts = load_workload(workload, prompts_file=args.prompts, limit=args.limit)
    loaded, engine, candidates, _ = _setup(args)
    cand = candidates[0] if candidates else None
    tok = loaded.tokenizer
    encoded = [(p.id, tok.encode_prompt(p.text, chat=p.chat)) for p in prompts]
    note_chat_fallback(tok, [p.chat for p in prompts])
    hw = detect(engine.model.device, engine.model.dtype, recalibrate=args.recalibrate)
    console = progress_console()
    with progress_bar(console) as bar:
        task = bar.add_task("profile", total=1)

        def progress(phase: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, description=f"profile: {phase}")

        try:
            report = profile(
                engine,
                encoded,
                cand.make_drafter if cand else (lambda: None),
                cand.spec if cand else None,
                cfg,
                eos_ids=tok.eos_ids,
                hardware=hw,
                progress=progress,
                alternatives=alternative_drafters(loaded, cand.drafter)
                if cand and args.compare_drafters
                else None,
            )
        except LossyPlanError as e:
            lossy = e
        else:
            lossy = None
    if lossy is not None:
        render_lossy(console, lossy)
        return 1
    render(console, report, cand.name if cand else "none (AR)", args.max_new_tokens)
    meta = {
        "model": loaded.source,
        "workload": workload or args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "attention": engine.attention,
        "weights": "native" if engine.model.native else "fp32",
        "linear": args.linear,
        "numerics": engine.cfg.numerics,
        "device": args.device,
    }
    if args.json:
        Path(args.json).write_text(json.dumps({**report.to_json(), **meta}, indent=2) + "\n")
    if args.html:
        title = f"specpilot profile: {cand.name if cand else 'AR'} on {meta['workload']}"
        Path(args.html).write_text(to_html(report, title))
    return 0


def render_lossy(console: Any, e: Any) -> None:
    """The forcing report of a plan that failed token forcing: the summary, one row per
    diverging prompt."""
    from rich.table import Table

    rep = e.forcing
    console.print(f"[red]{e}[/red]")
    t = Table(title=f"token forcing of the {e.run} run: {rep.status}")
    for col in ("prompt", "token", "reference", "plan", "margin", "near-tie"):
        t.add_column(col, justify="left" if col == "prompt" else "right")
    for d in rep.divergences:
        t.add_row(
            d.prompt_id,
            str(d.position),
            "<end>" if d.reference_token is None else str(d.reference_token),
            "<end>" if d.candidate_token is None else str(d.candidate_token),
            "-" if d.ref_margin is None else f"{d.ref_margin:.3g}",
            "yes" if d.is_near_tie(rep.tie_threshold) else "no",
        )
    console.print(t)


def _budgets_table(r: Any) -> Any:
    """tau_opt / tau_bf and the step cost per node budget N; the plan's N* marked."""
    from rich.table import Table

    b = Table(title="exact replay: tau vs node budget N (step = verify at width N+1 + propose)")
    for col in ("N", "tau_opt", "tau_bf", "verify ms", "draft ms", "oracle tok/s"):
        b.add_column(col, justify="right")
    for p in r.budgets:
        mark = " *" if p.n == r.n_star else ""
        b.add_row(
            f"{p.n}{mark}",
            f"{p.tau_opt:.3f}",
            f"{p.tau_bf:.3f}",
            f"{p.verify_ms:.2f}",
            f"{p.draft_ms:.3f}",
            f"{p.throughput:.1f}",
        )
    return b


def _drafters_table(r: Any) -> Any:
    """The replayed drafters' N* points; the one the tau factor compares against marked."""
    from rich.table import Table

    d = Table(title="drafters under exact replay (the tau factor compares the best)")
    for col in ("drafter", "N*", "tau_opt(N*)", "oracle tok/s"):
        d.add_column(col, justify="left" if col == "drafter" else "right")
    for p in r.tau_drafters:
        mark = " *" if p.drafter == r.tau_drafter else ""
        d.add_row(f"{p.drafter}{mark}", str(p.n), f"{p.tau_opt:.3f}", f"{p.throughput:.1f}")
    return d


def render(console: Any, r: Any, plan: str, max_new_tokens: int) -> None:
    """Factor, kernel-class and budget tables."""
    from rich.table import Table

    t = Table(
        title=f"specpilot profile: {plan}, {r.n_prompts} prompts x {max_new_tokens} tokens; "
        f"gap {r.gap:.2f}, direction [bold]{r.direction}[/bold]"
    )
    for col in ("factor", "value", "what"):
        t.add_column(col, justify="right" if col == "value" else "left")
    best = next((p for p in r.tau_drafters if p.drafter == r.tau_drafter), None)
    of = f" of {best.drafter}" if best is not None and best.alternative else ""
    n_star = best.n if best is not None else r.n_star
    t.add_row(
        "tau",
        f"{r.tau_factor:.3f}",
        f"tau_opt{of}(N*={n_star}) / tau_actual {r.tau_actual:.3f} (raw {r.tau_factor_raw:.3f})",
    )
    t.add_row(
        "kernel",
        f"{r.kernel_factor:.3f}",
        f"measured / floor per step, a class at least its floor (alpha {r.alpha:.2f}, "
        f"beta {r.beta:.2f})",
    )
    t.add_row(
        "overhead",
        f"{r.overhead_factor:.3f}",
        f"wall {r.wall_step_ms:.3f} ms / kernel {r.kernel_step_ms:.3f} ms per step",
    )
    t.add_row("gap", f"{r.gap:.3f}", "product")
    console.print(t)

    k = Table(title=f"kernel classes per decode step ({r.hardware.name}, {r.hardware.source})")
    for col in ("class", "GFLOP", "MB", "floor ms", "measured ms", "measured/floor"):
        k.add_column(col, justify="left" if col == "class" else "right")
    for row in r.kernels:
        ratio = f"{row.measured_ms / row.floor_ms:.1f}" if row.floor_ms > 0 else "-"
        k.add_row(
            row.name,
            f"{row.flops / 1e9:.4f}",
            f"{row.bytes / 1e6:.3f}",
            f"{row.floor_ms:.4f}",
            f"{row.measured_ms:.4f}",
            ratio,
        )
    console.print(k)
    console.print(r.hardware.describe(), soft_wrap=True)  # the peaks the floors came from
    for note in r.hardware.notes:
        console.print(f"[yellow]warning: {note}[/yellow]", soft_wrap=True)

    console.print(_budgets_table(r))
    if len(r.tau_drafters) > 1:
        console.print(_drafters_table(r))
    changes = sorted({s.direction for s in r.sensitivity})
    console.print(
        f"tau_actual {r.tau_actual:.3f}; replay of the plan's own trees {r.tau_replay_plan:.3f}; "
        f"tau_bf at the plan's budget {r.tau_bf_at_plan:.3f}"
    )
    console.print(
        "direction with alpha/beta +-20%: "
        + ("stable" if r.direction_stable else f"CHANGES among {', '.join(changes)}")
    )
    pr = r.profiler
    console.print(
        f"profiler: {pr['events_per_step']:.0f} events/step at {pr['per_event_us']:.2f} us each "
        f"(profiled wall {pr['profiled_wall_step_ms']:.1f} ms/step; kernel time "
        f"{pr['raw_kernel_step_ms']:.1f} ms raw -> {r.kernel_step_ms:.1f} ms corrected"
        + (f", of which {pr['clocked_ms_per_step']:.1f} ms timed by the one-op forward's own "
           "clock" if pr.get("clocked_ms_per_step") else "") + ")"
    )  # fmt: skip
    phases = ", ".join(f"{name} {s:.1f}s" for name, s in r.phases_s.items())
    console.print(f"profile wall time {r.profile_s:.1f}s ({phases})")
    console.print(f"token forcing: {r.forcing}")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m specpilot.cli_profile``): ``specpilot profile ...``."""
    from specpilot.cli import main as cli_main

    return cli_main(["profile", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
