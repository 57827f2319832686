"""``specpilot train-drafter``: distill a head or block drafter from a target (renders progress).

Found by :mod:`specpilot.cli` like every ``cli_*`` module (``add_parser(sub)`` and ``run(args)``).
The work (data, loop, checkpoints, evaluation) is :func:`specpilot.training.distill.train_drafter`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import Any

from specpilot.cli import DEFAULT_MODEL, progress_console
from specpilot.errors import ConfigError

DESCRIPTION = (
    "Train a drafter for a target by distillation: the target's greedy continuations of "
    "training prompts and teacher-forced text, KL to the target's next-token distribution, "
    "unrolled several steps deep. Checkpoints as it goes (--resume continues after a kill), "
    "reports held-out tau, and writes DIR atomically (load it with --drafter DIR)."
)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``train-drafter`` subcommand to ``build_parser``'s subparsers."""
    p = subparsers.add_parser(
        "train-drafter", help="train a head or block drafter for a target", description=DESCRIPTION
    )
    p.add_argument("--target", default=DEFAULT_MODEL, help="target model (default: %(default)s)")
    p.add_argument("--kind", choices=["head", "block"], default="head", help="drafter kind")
    p.add_argument("--out", required=True, help="output drafter directory")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="--out may name an existing file or non-drafter directory: it is moved aside "
        "(NAME.old-<time>) once the new drafter is complete",
    )
    p.add_argument(
        "--data",
        action="append",
        default=None,
        help="training data: code (stdlib functions), chat (templated instructions), text "
        "(teacher-forced stdlib source) or a JSONL prompts file; repeatable "
        "(default: code, chat, text)",
    )
    p.add_argument("--minutes", type=float, default=20.0, help="training-loop wall budget")
    p.add_argument(
        "--gen-minutes", type=float, default=10.0, help="budget for generating continuations"
    )
    p.add_argument("--resume", action="store_true", help="continue an interrupted run")
    p.add_argument("--max-new-tokens", type=int, default=128, help="continuation length")
    p.add_argument("--gen-batch", type=int, default=32, help="prompts per generation batch")
    p.add_argument("--text-tokens", type=int, default=40_000, help="teacher-forced text tokens")
    p.add_argument("--max-prompts", type=int, default=None, help="use at most N prompts")
    p.add_argument("--seq-len", type=int, default=256, help="training segment length")
    p.add_argument("--batch", type=int, default=8, help="segments per optimizer step")
    p.add_argument("--unroll", type=int, default=6, help="head: training-time-test depth")
    p.add_argument("--block", type=int, default=8, help="block drafter: tokens per block")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--loss-share", type=float, default=1.0, help="head: share of positions in the loss"
    )
    p.add_argument("--ffn", type=int, default=0, help="drafter MLP width (0 = the target's)")
    p.add_argument(
        "--draft-vocab", type=int, default=8192, help="reduced output vocabulary (0 = full)"
    )
    p.add_argument("--taps", default=None, help="tapped target layers, e.g. 2,15,30")
    p.add_argument(
        "--tap-norm",
        choices=["auto", "on", "off"],
        default="auto",
        help="RMS-normalize each tapped state before the fuse (auto: when their scales differ "
        "by more than 32x, as Gemma 3's; fixed by a work directory's first run)",
    )
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for tau")
    p.add_argument("--eval-tokens", type=int, default=64, help="tokens per held-out prompt")
    p.add_argument("--eval-budget", type=int, default=32, help="node budget for held-out tau")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "fp32", "native"],
        help="the target's GGUF weights, as for generate (default: %(default)s); the drafter "
        "learns the features of the weights it will be run with",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def run(args: argparse.Namespace) -> int:
    """Train and save; 0 on success."""
    import torch

    from specpilot.loading import load_model
    from specpilot.training.distill import train_drafter
    from specpilot.training.output import check_out, check_taps

    cfg = _config(args)
    out = check_out(args.out, overwrite=args.overwrite, resume=args.resume)
    if args.threads is not None:
        if args.threads <= 0:
            raise ConfigError("--threads must be positive")
        torch.set_num_threads(args.threads)
    loaded = load_model(args.target, device=args.device, weights=args.weights)
    for note in loaded.notes:
        print(f"specpilot: note: {note}", file=sys.stderr)
    check_taps(cfg.taps, loaded.model.cfg.n_layers)
    console = progress_console()
    command = "specpilot " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    with _bar(console) as bar:
        tasks: dict[str, Any] = {}
        last = [0.0]

        def progress(phase: str, done: float, total: float, info: dict[str, float]) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total or 1, info="")
            text = " ".join(
                f"{k} {v:.3g}" if k != "tok_s" else f"tok/s {v:.0f}"
                for k, v in info.items()
                if k in ("loss", "acc1", "acc2", "acc3", "tok_s", "step", "prompts")
            )
            bar.update(tasks[phase], completed=done, total=total or 1, info=text)
            now = time.monotonic()
            if not console.is_terminal and now - last[0] >= 30:  # a log file: a line now and then
                last[0] = now
                console.print(f"{phase} {done:.0f}/{total:.0f} {text}", soft_wrap=True)

        res = train_drafter(
            loaded,
            cfg,
            out,
            resume=args.resume,
            overwrite=args.overwrite,
            command=command,
            progress=progress,
        )
    console.print(
        f"saved {res.out}: {res.steps} steps, {res.train_s / 60:.1f} min training, "
        f"{res.data_tokens} data tokens; held-out tau {res.eval_init.get('tau', 0):.2f} at init "
        f"-> {res.eval_final.get('tau', 0):.2f} (dynamic tree, {cfg.eval_budget} nodes, "
        f"{res.eval_final.get('prompts', 0)} prompts x {cfg.eval_tokens} tokens)"
    )
    if res.moved_aside is not None:
        console.print(
            f"the earlier content of --out {args.out} was moved to {res.moved_aside}",
            soft_wrap=True,
        )
    return 0


def _config(args: argparse.Namespace) -> Any:
    """The TrainConfig of the flags (validated: a bad value fails before anything loads)."""
    from specpilot.training.distill import TrainConfig

    taps: tuple[int, ...] = ()
    if args.taps:
        try:
            taps = tuple(int(x) for x in args.taps.split(","))
        except ValueError:
            raise ConfigError(
                f"--taps must be comma-separated integers, got {args.taps!r}"
            ) from None
    return TrainConfig(
        kind=args.kind,
        sources=tuple(args.data or ("code", "chat", "text")),
        minutes=args.minutes,
        gen_minutes=args.gen_minutes,
        max_new_tokens=args.max_new_tokens,
        gen_batch=args.gen_batch,
        text_tokens=args.text_tokens,
        max_prompts=args.max_prompts,
        seq_len=args.seq_len,
        batch=args.batch,
        unroll=args.unroll,
        block=args.block,
        lr=args.lr,
        loss_share=args.loss_share,
        ffn=args.ffn,
        draft_vocab=args.draft_vocab,
        taps=taps,
        tap_norm=args.tap_norm,
        eval_prompts=args.eval_prompts,
        eval_tokens=args.eval_tokens,
        eval_budget=args.eval_budget,
        seed=args.seed,
    )


def _bar(console: Any) -> Any:
    """Progress with a bar, percentage, elapsed, ETA and the loop's figures."""
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        "eta",
        TimeRemainingColumn(),
        "{task.fields[info]}",
        console=console,
    )
