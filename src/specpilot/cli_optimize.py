"""``specpilot optimize``: the pilot loop on the command line (renders; the loop is
:mod:`specpilot.pilot.coordinator`).

With no arguments it runs on the embedded default model, the default plan and the default
workloads (HumanEval and chat) for at most ``--budget-minutes`` and writes ``DIR/plan.json``,
``DIR/rounds.jsonl`` and ``DIR/report.html``. ``--resume DIR`` continues a run that was stopped
or killed; no finished trial is run twice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from specpilot.cli import DEFAULT_MODEL, progress_console
from specpilot.errors import ConfigError

DESCRIPTION = (
    "Optimize a decoding plan: each round profiles the current plan (tau / kernel / overhead), "
    "explores mechanisms for the largest factor in token-forced, parent-timed trial "
    "subprocesses, and keeps only lossless changes faster than the measured spread (a speedup "
    "above the cost model's ceiling is flagged and re-measured first). Ctrl-C stops cleanly "
    "(the trial in flight is recorded as INTERRUPTED); --resume DIR continues."
)
DEFAULT_WORKLOADS = ("humaneval", "chat")
DEFAULT_MEMORY = "~/.cache/specpilot/memory.sqlite"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("optimize", help="the pilot loop: find a faster lossless plan",
                              description=DESCRIPTION)  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL, help="model (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--weights", default="auto", choices=["auto", "fp32", "native"],
                   help="GGUF weights of the target, in the loop and every trial (see bench "
                   "--weights; default: %(default)s)")  # fmt: skip
    p.add_argument("--drafter", default=None, help="start plan's drafter (default: the plan's)")
    p.add_argument("--start-plan", default=None, help="plan.json (or a run dir) to start from")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", action="append", default=None,
                     help="humaneval or chat, repeatable (default: both)")  # fmt: skip
    src.add_argument("--prompts", default=None, help="JSONL prompts file")
    p.add_argument("--limit", type=int, default=20, help="prompts per workload (default: 20)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budget-minutes", type=float, default=17.0,
                   help="wall-clock budget of the run (default: %(default)s)")  # fmt: skip
    p.add_argument("--out", default=None, help="run directory (default: runs/optimize-<time>)")
    p.add_argument("--memory", default=None,
                   help=f"mechanism memory database (default: {DEFAULT_MEMORY}; with --resume: "
                   "the run's own)")  # fmt: skip
    p.add_argument("--workers", type=int, default=None,
                   help="parallel trials (default: 1 on CPU, one per GPU)")  # fmt: skip
    p.add_argument("--executor", default="local", choices=["local", "ray"])
    p.add_argument("--resume", default=None, metavar="DIR", help="continue the run in DIR")
    p.add_argument("--candidates", type=int, default=4, help="candidates per round")
    p.add_argument("--max-rounds", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mechanisms", action="append", default=[], metavar="MODULE",
                   help="extra module exposing MECHANISMS (repeatable)")  # fmt: skip
    p.add_argument("--no-recall", action="store_true",
                   help="do not start by trying memory's remembered winners stacked")  # fmt: skip
    p.add_argument("--no-registry", action="store_true",
                   help="explore only the --mechanisms modules' mechanisms")  # fmt: skip
    p.add_argument("--python-path", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help="set any OptimizeConfig field, e.g. --set timed_rounds=5")  # fmt: skip
    p.add_argument("--memory-limit-gb", type=float, default=8.0,
                   help="address-space limit of each trial process (0 = none)")  # fmt: skip
    p.add_argument("--trial-timeout", type=float, default=600.0,
                   help="seconds of child time one trial may use")  # fmt: skip
    g = p.add_argument_group("LLM agents (docs/agent.md)")
    g.add_argument("--agent", choices=["openai"], default=None,
                   help="agents on an OpenAI-compatible endpoint propose mechanisms (sandboxed, "
                   "token-forced); default: the built-in explorer only")  # fmt: skip
    g.add_argument("--agent-base-url", default=None, help="e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--agent-model", default=None, help="model name at the endpoint")
    g.add_argument("--agent-api-key-env", default="OPENAI_API_KEY", metavar="VAR",
                   help="variable holding the API key (default: %(default)s)")  # fmt: skip
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def _config(args: argparse.Namespace) -> Any:
    from specpilot.pilot.config import OptimizeConfig
    from specpilot.pilot.trial import TrialLimits
    from specpilot.plan import load_plan
    from specpilot.workloads import load_workload

    if args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    if args.memory_limit_gb < 0:
        raise ConfigError(f"--memory-limit-gb must be >= 0 (0 = none), got {args.memory_limit_gb}")
    workers = args.workers
    if workers is None:
        import torch

        workers = torch.cuda.device_count() if args.device.startswith("cuda") else 1
    out = args.resume or args.out or f"runs/optimize-{time.strftime('%Y%m%d-%H%M%S')}"
    from specpilot.outpaths import check_output_path

    check_output_path(out, "--resume" if args.resume else "--out", kind="dir", overwrite=None)
    memory = args.memory or DEFAULT_MEMORY
    if args.resume and args.memory is None:
        from specpilot.pilot.journal import Journal, replay

        journal = Journal(Path(args.resume).expanduser())
        if journal.exists():
            memory = replay(journal).run.config.get("memory", memory)
    texts: list[tuple[str, str, bool]] = []
    if not args.resume:
        if args.prompts:
            ps = load_workload(prompts_file=args.prompts)
            texts = [(p.id, p.text, p.chat) for p in ps]
        else:
            for w in args.workload or DEFAULT_WORKLOADS:
                texts += [(p.id, p.text, p.chat) for p in load_workload(w, limit=args.limit)]
    start = load_plan(args.start_plan).to_json() if args.start_plan else None
    mem = args.memory_limit_gb
    limits = TrialLimits(
        trial_timeout_s=args.trial_timeout,
        memory_bytes=0 if mem <= 0 or args.device.startswith("cuda") else int(mem * (1 << 30)),
    )
    extra: dict[str, Any] = {}
    for item in args.set:
        name, sep, raw = item.partition("=")
        if not sep or name not in OptimizeConfig.__dataclass_fields__:
            raise ConfigError(f"--set {item!r}: expected FIELD=JSON with an OptimizeConfig field")
        try:
            extra[name] = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--set {item!r}: the value is not JSON ({e})") from None
    if "limits" in extra:
        extra["limits"] = TrialLimits(**{**asdict(limits), **extra["limits"]})
    agent = _agent(args, extra.pop("agent", None))
    fields = dict(
        out=str(out), model=_model_ref(args.model), memory=memory, texts=tuple(texts),
        start_plan=start, drafter=args.drafter, budget_minutes=args.budget_minutes,
        workers=workers, executor=args.executor, device=args.device, weights=args.weights,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens, candidates_per_round=args.candidates,
        max_rounds=args.max_rounds, limits=limits, modules=tuple(args.mechanisms),
        python_path=tuple(args.python_path), registry=not args.no_registry,
        recall=not args.no_recall, agent=agent,
    )  # fmt: skip
    fields.update(extra)
    return OptimizeConfig(**fields)


def _agent(args: argparse.Namespace, extra: Any) -> Any:
    """The AgentConfig JSON of ``--agent ...`` (``--set agent={...}`` adds fields), validated
    here; None without."""
    from specpilot.agent.config import AgentConfig

    if args.agent is None:
        if args.agent_base_url or args.agent_model or extra:
            raise ConfigError("--agent-base-url / --agent-model / --set agent need --agent openai")
        return None
    if extra is not None and not isinstance(extra, dict):
        raise ConfigError("--set agent=...: expected a JSON object")
    base = {"kind": args.agent, "base_url": args.agent_base_url or "",
            "model": args.agent_model or "", "api_key_env": args.agent_api_key_env}  # fmt: skip
    return AgentConfig.from_json({**base, **(extra or {})}).to_json()


def _model_ref(model: str) -> str:
    """A model path made absolute (trial processes run in their own scratch directories); a
    known name is kept."""
    p = Path(model).expanduser()
    return str(p.resolve()) if p.exists() else model


class _View:
    """Progress bar over the budget and a live table of the current round, plus one printed line
    per finished trial (visible while the run goes, also when stderr is not a terminal)."""

    def __init__(self, console: Any, budget_s: float) -> None:
        from rich.live import Live

        self.console = console
        self.budget_s = budget_s
        self.rows: dict[str, list[str]] = {}
        self.head = "starting"
        self.t0 = time.monotonic()
        self.elapsed0 = 0.0
        self.done = False
        self.live = Live(self._render(), console=console, refresh_per_second=2, transient=False)

    def _render(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        if self.done:  # the summary follows on its own lines
            return Text("")
        used = self.elapsed0 + time.monotonic() - self.t0
        t = Table(title=self.head, expand=False)
        for col in ("mechanism", "params", "from", "status", "speedup", "reason"):
            t.add_column(col, overflow="fold", max_width=40 if col == "reason" else None)
        for row in self.rows.values():
            t.add_row(*row)
        bar = ProgressBar(total=self.budget_s, completed=min(used, self.budget_s), width=60)
        return Group(f"budget {used / 60:.1f} / {self.budget_s / 60:.1f} min", bar, t)

    def __call__(self, kind: str, d: Any) -> None:
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(d)
        self.live.update(self._render())

    def _on_start(self, d: Any) -> None:
        self.elapsed0, self.t0 = d.elapsed, time.monotonic()
        self.head = f"run {d.run_id}" + (" (resumed)" if d.resumed else "")

    def _on_reference(self, d: Any) -> None:
        self.head = f"reference outputs {d.done + 1}/{d.total}"

    def _on_profile_start(self, rnd: int) -> None:
        self.head = f"round {rnd}: phase 0, cost model"

    def _on_profile(self, d: Any) -> None:
        f = d.factors
        self.console.print(f"round {d.round}: "
                           + (", ".join(f"{k} {v:.3f}" for k, v in f.items()) if f else d.reason))

    def _on_round(self, d: Any) -> None:
        for e in d.agent:
            if e.get("stage") != "accepted":
                self.console.print(f"agent {e.get('agent')} ({e.get('direction')}): "
                                   f"{e.get('status')} at {e.get('stage')}: "
                                   f"{str(e.get('reason'))[:160]}")  # fmt: skip
        self.head = f"round {d.round}: direction {', '.join(d.directions) or '-'}"
        self.rows = {it.key: [it.mechanism, json.dumps(it.params)[:40], it.source, "queued", "", ""]
                     for it in d.candidates}  # fmt: skip

    def _on_trial_start(self, d: Any) -> None:
        it = d.item
        row = self.rows.setdefault(it.key, [it.mechanism, json.dumps(it.params)[:40], d.kind,
                                            "", "", ""])  # fmt: skip
        row[3] = "running" if d.kind == "explore" else "integrating"
        self.head = f"round {d.round}: {d.kind} {it.mechanism}"

    def _on_trial_done(self, rec: Any) -> None:
        r = rec.result
        mech = rec.steps[-1][0] if rec.steps else "-"
        row = self.rows.setdefault(rec.key, [mech, "", rec.kind, "", "", ""])
        row[3] = r.status
        row[4] = f"{r.speedup:.3f} ± {r.spread or 0:.3f}" if r.speedup else "-"
        row[5] = (r.reason or "")[:160]
        params = json.dumps(rec.steps[-1][1] if rec.steps else {})[:60]
        why = f": {(r.reason or '').splitlines()[0][:100]}" if r.reason else ""
        self.console.print(f"  round {rec.round} {rec.kind} {mech} {params}: {r.status} "
                           f"{row[4]} in {r.duration_s:.0f} s{why}")  # fmt: skip

    def _on_flag(self, f: Any) -> None:
        self.console.print(f"  {f.mechanism}: {f.speedup:.3f}x is above the cost model's ceiling "
                           f"({f.ceiling:.3f}x); flagged, re-measured before it can be kept")

    def _on_stopping(self, why: str) -> None:
        self.head = "stopping: trials in flight end INTERRUPTED (Ctrl-C again to abort at once)"
        self.console.print(f"stopping: {why}")

    def _on_done(self, d: Any) -> None:
        self.done = True

    def _on_round_end(self, d: Any) -> None:
        kept = ", ".join(f"{k.mechanism} {k.speedup:.3f}x" for k in d.kept)
        self.console.print(self._render())
        self.console.print(f"round {d.round} kept: {kept or 'nothing'}")
        self.rows = {}


@contextlib.contextmanager
def _first_sigint_stops(stop: Any) -> Iterator[None]:
    """The first SIGINT calls ``stop()`` (a clean stop); the second one interrupts at once."""

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stop()

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def run(args: argparse.Namespace) -> int:
    """Run (or resume) the loop; 0 when it finished, 130 when the first SIGINT stopped it."""
    from specpilot.agent.explorer import agent_explorer
    from specpilot.pilot.coordinator import Coordinator

    cfg = _config(args)
    console = progress_console()
    view = _View(console, cfg.budget_minutes * 60)
    coord = Coordinator(cfg, resume=bool(args.resume), on_event=view,
                        explorer_factory=agent_explorer)  # fmt: skip
    with _first_sigint_stops(coord.stop):
        coord.prepare()  # user errors before the live view: one clean line
        with view.live:
            summary = coord.run()
    _print_summary(console, summary)
    return 130 if summary.interrupted else 0


def _print_summary(console: Any, summary: Any) -> None:
    out = Path(summary.out)
    console.print(
        f"{summary.rounds} round(s), {summary.trials} trial(s) "
        f"({', '.join(f'{k} {v}' for k, v in sorted(summary.statuses.items())) or 'none'}) "
        f"in {summary.elapsed_s / 60:.1f} min"
    )
    console.print(f"stopped: {summary.stop_reason}")
    console.print(f"start plan: {summary.start_plan}")
    console.print(f"final plan: {summary.final_plan} (loop's own estimate "
                  f"{summary.loop_speedup:.2f}x over the start plan)")  # fmt: skip
    for k in summary.kept:
        console.print(f"  kept {k.mechanism} {k.params}: {k.speedup:.3f}x ± {k.spread:.3f}")
    console.print(f"plan: {out / 'plan.json'}  report: {out / 'report.html'}  "
                  f"log: {out / 'rounds.jsonl'}")  # fmt: skip
    if summary.sandbox:
        console.print(f"agent-written code ran sandboxed: {summary.sandbox}")
    if summary.interrupted:
        console.print(f"continue with: specpilot optimize --resume {out}")
    else:
        console.print(f"verify independently: specpilot bench --plan {out / 'plan.json'}")


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m specpilot.cli_optimize``): ``specpilot optimize ...``."""
    from specpilot.cli import main as cli_main

    return cli_main(["optimize", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
