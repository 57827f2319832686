"""Where one verify step's time goes: the engine's step, the layers' one op call, the kernel
classes it timed inside with its own clock, and the LM head, at a few row counts.

Usage: python bench/forward_parts.py [--threads 2] [--numerics int8] [--context 200]
       [--rows 1 4] [--repeats 60]

The default plan's engine (the CLI's setup) steps a chain of M - 1 nodes at ``--context`` cached
tokens, ``--repeats`` times per row count after a warm-up, with the class clock on
(:func:`specpilot.profiling.clocking`; two clock reads a section). Prints medians: the step, the
``specpilot::lean_run`` call (the op as Python calls it: call inputs converted, the plan held in
C++), the classes its clock summed (the op's time minus them is its own overhead), the LM head
call; then the classes per layer in microseconds. Python's glue is the step minus the op and the
LM head.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from specpilot import plan_setup
from specpilot.cli import build_parser
from specpilot.kernels import stack
from specpilot.profiling import clocking
from specpilot.tree import DraftTree


def _timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def run(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = fn(*a, **k)
        into.append(time.perf_counter() - t)
        return out

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--numerics", default="int8", choices=("fp32", "int8"))
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    cli = build_parser().parse_args(
        ["bench", "--threads", str(args.threads), "--numerics", args.numerics]
    )
    torch.set_num_threads(args.threads)
    eng = plan_setup.setup(cli).engine
    model, c = eng.model, args.context
    eng._ensure_cache(c + max(args.rows) + 2)
    op_s: list[float] = []
    head_s: list[float] = []
    stack.run = _timed(stack.run, op_s)  # type: ignore[assignment]
    head = model.lm_head
    head.forward = _timed(head.forward, head_s)  # type: ignore[method-assign]
    n_layers = model.cfg.n_layers
    print(f"threads={args.threads} numerics={args.numerics} context={c}")
    with torch.inference_mode():
        for rows in args.rows:
            tree = DraftTree.chain([5] * (rows - 1)) if rows > 1 else DraftTree.empty()
            for _ in range(10):
                eng.step(5, c, tree)
            op_s.clear()
            head_s.clear()
            steps, clocked = [], []
            per_class: collections.Counter[str] = collections.Counter()
            for _ in range(args.repeats):
                with clocking() as clock:
                    t = time.perf_counter()
                    eng.step(5, c, tree)
                    steps.append(time.perf_counter() - t)
                clocked.append(sum(clock.values()))
                per_class.update(clock)
            med = statistics.median
            print(
                f"M={rows:3d}  step {med(steps) * 1e3:.3f} ms  lean_run {med(op_s) * 1e3:.3f} ms  "
                f"its classes {med(clocked) * 1e3:.3f} ms  LM head {med(head_s) * 1e3:.3f} ms"
            )
            layer = {k: v / args.repeats / n_layers * 1e6 for k, v in per_class.items()}
            print("        per layer (us): " + ", ".join(f"{k} {v:.1f}" for k, v in layer.items()))


if __name__ == "__main__":
    main()
