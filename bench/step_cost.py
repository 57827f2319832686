"""Time one target forward that verifies M rows (M = draft nodes + 1) on the default model.

Usage: python bench/step_cost.py [--threads 2] [--context 100]
"""

from __future__ import annotations

import argparse
import time

import torch

from specpilot.engine import Engine, EngineConfig
from specpilot.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m")
    Engine(loaded.model, EngineConfig(attention="exact"))  # prepacks the weights
    model = loaded.model
    model.setup_cache(args.context + 64, attention="exact")
    c = args.context
    with torch.no_grad():
        for m in (1, 2, 4, 8, 16, 32):
            tok = torch.full((1, m), 5)
            pos = (torch.arange(m) + c)[None]
            for _ in range(3):
                model(tok, pos, c, c + m)
            t = time.perf_counter()
            for _ in range(args.repeats):
                model(tok, pos, c, c + m)
            print(f"M={m:3d}  {(time.perf_counter() - t) / args.repeats * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
