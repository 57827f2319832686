"""Time one target forward that verifies M rows (M = draft nodes + 1) on the default model.

Usage: python bench/step_cost.py [--threads 2] [--context 100] [--weights auto|native|fp32]
       [--numerics fp32|int8] [--rows 1 2 4 ...] [--prefetch 0 8 16 ...]

The model runs as the engine runs it (``Engine`` applies the weights mode, row ops, numerics and
attention the defaults choose); the tree mask is the causal one (a chain), which costs what any
tree of M rows costs in the GEMMs. ``--prefetch``: the int8 GEMMs' prefetch distances in columns
(the ``kernel_prefetch`` mechanism; 0 = the schedules' own), each timed at every row count, in
turn, in one process.
"""

from __future__ import annotations

import argparse
import time

import torch

from specpilot.engine import Engine, EngineConfig
from specpilot.kernels import int8
from specpilot.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--weights", default="auto", choices=("auto", "native", "fp32"))
    ap.add_argument("--numerics", default="fp32", choices=("fp32", "int8"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32, 64])
    ap.add_argument("--prefetch", type=int, nargs="+", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, weights=args.weights)
    eng = Engine(loaded.model, EngineConfig(numerics=args.numerics))
    model = loaded.model
    c = args.context
    model.setup_cache(c + max(args.rows) + 1, attention=eng.cfg.resolved_attention)
    native = getattr(model, "native", False)
    print(f"weights={'native' if native else 'fp32'} numerics={args.numerics} "
          f"attention={eng.cfg.resolved_attention} threads={args.threads} context={c}")
    with torch.inference_mode():
        model(torch.full((1, c), 5), torch.arange(c)[None], 0, c)
        for m in args.rows:
            tok = torch.full((1, m), 5)
            pos = (torch.arange(m) + c)[None]
            for ahead in args.prefetch or [None]:
                label = "" if ahead is None else f"  prefetch {ahead:3d}"
                if ahead is not None:
                    int8.set_prefetch(ahead)
                for _ in range(2):
                    model(tok, pos, c, c + m)
                best = float("inf")
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    model(tok, pos, c, c + m)
                    best = min(best, time.perf_counter() - t)
                print(f"M={m:3d}{label}  {best * 1e3:7.1f} ms  ({best * 1e3 / m:6.2f} ms/row)")


if __name__ == "__main__":
    main()
