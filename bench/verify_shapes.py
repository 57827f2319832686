"""One packed batched verify step by its shape: the same rows spread over many or few sequences
(per-sequence costs of accepting and committing a tree beside the rows' forward).

    python bench/verify_shapes.py [--numerics int8] [--threads 2] [--rounds 6]

Each case is B sequences with a chain of K draft nodes each (B x (K + 1) rows, packed), at
contexts of 150-243 cached tokens; prints the median and best milliseconds per step over the
rounds (cases interleaved). The goodput budget's cost curve is measured on one sequence
(specpilot.goodput.curve), so what a shape adds over its row count is what the curve misses.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specpilot.engine import Engine, EngineConfig
from specpilot.loading import load_model
from specpilot.tree import DraftTree
from specpilot.verify import VerifyRow, verify_step

CASES = ((32, 0), (32, 1), (16, 3), (8, 7), (2, 31), (32, 2), (1, 63))
"""(sequences, draft nodes each)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--numerics", default="int8", choices=("fp32", "int8"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    engine = Engine(loaded.model, EngineConfig(numerics=args.numerics))
    model, slots = loaded.model, 400
    model.setup_cache(slots, batch=max(b for b, _ in CASES), attention=engine.attention)

    def rows(b: int, k: int) -> list[VerifyRow]:
        tree = DraftTree.chain([7 + j for j in range(k)], [0.0] * k) if k else DraftTree.empty()
        return [VerifyRow(100 + i, 150 + 3 * i, tree) for i in range(b)]

    times: dict[tuple[int, int], list[float]] = {c: [] for c in CASES}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for b, k in CASES:
                batch = rows(b, k)
                t = time.perf_counter()
                verify_step(model, batch, (), cache_rows=slice(0, b), scratch=slots - 1,
                            packed=True)  # fmt: skip
                times[(b, k)].append(time.perf_counter() - t)
    print(f"numerics={args.numerics} threads={args.threads} rounds={args.rounds}")
    print(f"{'sequences':>9s} {'nodes each':>10s} {'rows':>5s} {'median ms':>10s} {'best ms':>8s}")
    for (b, k), v in times.items():
        print(f"{b:9d} {k:10d} {b * (k + 1):5d} {1e3 * statistics.median(v):10.1f} "
              f"{1e3 * min(v):8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
