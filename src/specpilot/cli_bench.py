"""``specpilot bench``: plain decoding vs speculative decoding on the same prompts, interleaved,
token-forced (``--batch-size N``: batched AR vs batched speculative). Renders
:func:`specpilot.bench.run_bench` and :func:`specpilot.bench_batch.run_batch_bench`; found by
:mod:`specpilot.cli` like every ``cli_*`` module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
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
from specpilot.outpaths import check_output_path


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    b = subparsers.add_parser(
        "bench",
        help="AR vs speculative decoding side by side, token-forced",
        description="Run plain AR and speculative decoding on the same prompts, "
        "verify token forcing, report tokens/s, tau and speedup.",
    )
    _model_args(b)
    _drafter_args(b)
    _plan_args(b)
    _workload_args(b)
    b.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed rounds; median reported (with --batch-size every other round runs the modes "
        "in reverse: plain, speculative, speculative, plain)",
    )
    b.add_argument(
        "--peers",
        action="append",
        default=[],
        choices=["hf", "llama.cpp"],
        help="also run Hugging Face transformers greedy, prompt lookup, and (with "
        "--draft-model) assisted generation on the same weights (hf), or llama.cpp plain and "
        "prompt lookup decoding on the same GGUF file (llama.cpp; needs specpilot[llamacpp])",
    )
    b.add_argument("--json", default=None, help="write results to this JSON file")
    s = b.add_argument_group("sampling (seeded: the same text with and without speculation)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (needed to sample)")
    b.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="decode N prompts together (continuous batching): batched AR vs batched "
        "speculative, throughput and per-request latency",
    )
    b.add_argument(
        "--min-gain",
        type=float,
        default=0.0,
        help="with --batch-size: verify only draft nodes whose path acceptance probability "
        "(exp of the drafter's score) is at least this (default: 0, all the budget allows)",
    )
    b.add_argument("--ignore-eos", action="store_true", help="always generate max-new-tokens")
    b.add_argument(
        "--no-strict",
        action="store_true",
        help="tolerate divergences at near-ties (top-2 logit gap < 1e-3)",
    )
    return b


def _sampling(args: argparse.Namespace) -> Any:
    from specpilot.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def run(args: argparse.Namespace) -> int:
    return _cmd_bench(args)


def omp_note(env: Mapping[str, str]) -> str | None:
    """A note when the environment sets passive OpenMP waits: every kernel's worker threads
    then sleep between parallel regions, and a decode step has hundreds of them.

    >>> omp_note({"OMP_WAIT_POLICY": "passive"}) is not None, omp_note({}) is None
    (True, True)
    """
    if env.get("OMP_WAIT_POLICY", "").strip().lower() != "passive":
        return None
    return (
        "OMP_WAIT_POLICY=PASSIVE is set: decoding runs slower on a quiet machine (2.4x on one "
        "2-vCPU host, BENCHMARKS.md); it helps only when other jobs share the cores. Unset it "
        "to benchmark; the JSON records it as omp_wait_policy"
    )


def _cmd_bench(args: argparse.Namespace) -> int:

    from specpilot.bench import BenchConfig, run_bench
    from specpilot.workloads import load_workload

    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {args.limit}")
    cfg = BenchConfig(
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        stop_on_eos=not args.ignore_eos,
        strict=not args.no_strict,
        sampling=_sampling(args),
    )
    workload = None if args.prompts else (args.workload or "humaneval")
    prompts = load_workload(workload, prompts_file=args.prompts, limit=args.limit)
    if args.json:
        check_output_path(args.json, "--json")
    note = omp_note(os.environ)
    if note:
        print(f"specpilot: note: {note}", file=sys.stderr)
    loaded, engine, candidates, peers = _setup(args, hf_peers="hf" in args.peers)
    tok = loaded.tokenizer
    encoded = [(p.id, tok.encode_prompt(p.text, chat=p.chat)) for p in prompts]
    note_chat_fallback(tok, [p.chat for p in prompts])
    if args.batch_size is not None:
        return _bench_batch(args, loaded, engine, candidates, encoded)
    peers = [*peers, *_llamacpp_peers(args, loaded.source, encoded)]
    console = progress_console()
    with progress_bar(console) as bar:
        task = bar.add_task("bench", total=len(encoded) * cfg.repeats)

        def progress(pid: str, done: int, total: int) -> None:
            bar.update(task, completed=done, description=f"bench {pid}")

        res = run_bench(
            engine, encoded, candidates, cfg, eos_ids=tok.eos_ids, peers=peers, progress=progress
        )
    out = res.to_json()
    out.update(
        model=loaded.source,
        workload=workload or args.prompts,
        threads=args.threads,
        attention=engine.attention,
        weights="native" if engine.model.native else "fp32",
        linear=args.linear,
        numerics=engine.cfg.numerics,
        device=args.device,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
    )
    if engine.selector is not None:
        out["goodput"] = engine.selector.summary()
        console.print(_goodput_line(out["goodput"]))
    _render_bench(console, res)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if res.lossless else 1


def _llamacpp_peers(args: argparse.Namespace, source: str, encoded: list[Any]) -> list[Any]:
    """The llama.cpp peers for ``--peers llama.cpp``; none, with a one-line notice, when
    llama-cpp-python is absent or the model is not a GGUF file."""
    if "llama.cpp" not in args.peers:
        return []
    from specpilot.peers.llamacpp import PeerUnavailable, bench_config, make_llamacpp_peers

    cfg = bench_config(source, args.threads, [len(p) for _, p in encoded], args.max_new_tokens)
    try:
        return make_llamacpp_peers(cfg)
    except PeerUnavailable as e:
        print(f"specpilot: note: {e}", file=sys.stderr)
        return []


def _bench_batch(
    args: argparse.Namespace, loaded: Any, engine: Any, candidates: list[Any], encoded: list[Any]
) -> int:
    """``bench --batch-size N``: batched AR vs batched speculative (throughput, latency)."""
    from rich.table import Table

    from specpilot.batch import BatchEngine
    from specpilot.bench_batch import (
        BatchBenchConfig,
        batch_config_for,
        plan_budget,
        run_batch_bench,
    )

    if args.peers:
        raise ConfigError("--peers is not available with --batch-size")
    cfg = BatchBenchConfig(
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        stop_on_eos=not args.ignore_eos,
        sampling=_sampling(args),
    )
    nodes = max((c.spec.max_nodes for c in candidates), default=0)
    budget = plan_budget(getattr(args, "plan", None), nodes)  # the plan's batch_budget table
    bcfg = batch_config_for(
        cfg.batch_size, [p for _, p in encoded], cfg.max_new_tokens, nodes, budget, args.min_gain
    )
    tok = loaded.tokenizer
    beng = BatchEngine(loaded.model, engine.cfg, bcfg, eos_ids=tok.eos_ids, detok=tok.decode)
    console = progress_console()
    with progress_bar(console) as bar:
        task = bar.add_task("bench", total=cfg.repeats * (1 + len(candidates)))
        res = run_batch_bench(
            beng,
            encoded,
            candidates,
            cfg,
            progress=lambda name, done, _: bar.update(task, completed=done, description=name),
        )
    t = Table(
        title=f"specpilot bench: {res.n_prompts} prompts x {res.max_new_tokens} tokens, "
        f"batch size {res.batch_size}"
    )
    for col in ("engine", "tok/s", "vs batched AR", "p50 latency s", "p99 latency s", "tau"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for m in (res.ar, *res.candidates):
        sp = res.speedup(m) if m is not res.ar else 1.0
        t.add_row(
            m.name,
            f"{m.tok_s:.1f}" if m.tok_s else "n/a (lossy)",
            f"{sp:.2f}x" if sp else "n/a",
            f"{m.latency_p50_s:.2f}",
            f"{m.latency_p99_s:.2f}",
            f"{m.tau:.2f}",
        )
    console.print(t)
    for m in res.candidates:
        console.print(f"{m.name}: forcing {m.forcing}")
    if beng.selector is not None:
        console.print(_goodput_line(beng.selector.summary()))
    if args.json:
        out = {**res.to_json(), "model": loaded.source, "threads": args.threads,
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}  # fmt: skip
        if beng.selector is not None:
            out["goodput"] = beng.selector.summary()
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if res.lossless else 1


def _goodput_line(g: dict[str, Any]) -> str:
    return (
        f"goodput budget: {g['steps']} steps, {g['plain_steps']} plain, {g['cheap_steps']} "
        f"drafted by a cheap part alone; verify step predicted "
        f"{g['predicted_ms']:.1f} ms, measured {g['actual_ms']:.1f} ms (mean of the last steps); "
        f"cost curve {g['curve_source']}"
    )


def _render_bench(console: Any, res: Any) -> None:
    from rich.table import Table

    t = Table(title=f"specpilot bench: {res.n_prompts} prompts x {res.max_new_tokens} tokens")
    for col in ("engine", "tok/s", "vs own AR", "tokens = AR", "tau", "nodes/step", "draft ms"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    t.add_row("AR (reference)", f"{res.ar_tok_s:.1f}", "1.00x", "-", "1.00", "0", "-")
    for c in res.candidates:
        t.add_row(
            c.name,
            f"{c.spec_tok_s:.1f}" if c.spec_tok_s else "n/a (lossy)",
            f"{c.speedup:.2f}x" if c.speedup else "n/a",
            f"{res.n_prompts - c.mismatches}/{res.n_prompts}",
            f"{c.tau:.2f}",
            f"{c.mean_draft_nodes:.1f}",
            f"{c.draft_ms_per_step:.2f}",
        )
    for name, ps in res.peers.items():
        t.add_row(
            name,
            f"{ps.tok_s:.1f}",
            f"{ps.tok_s / res.ar_tok_s:.2f}x",
            f"{ps.n_identical}/{ps.n_prompts}",
            "",
            "",
            "",
        )
    console.print(t)
    for c in res.candidates:
        depth = " ".join(f"{a:.2f}" for a in c.acceptance_by_depth)
        console.print(f"{c.name}: acceptance by depth {depth}; forcing {c.forcing.summary()}")
        if len(c.rounds_speedup) > 1 and c.paired_speedup is not None:
            pairs = " / ".join(f"{x:.3f}" for x in c.rounds_speedup)
            console.print(
                f"{c.name}: vs own AR round by round {pairs} (median {c.paired_speedup:.3f}x)"
            )
        for d in c.forcing.divergences[:5]:
            console.print(f"  {d.describe()}")
