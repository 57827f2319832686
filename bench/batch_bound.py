"""The most batched speculation could gain on this machine: the packed verify step's measured
cost at B sequences x k draft nodes each, against the tokens the best tree of k nodes would
commit per sequence (the cost model's exact-replay oracle, ``tau_opt``, from a
``specpilot profile --json`` file).

    python bench/batch_bound.py --profile PROFILE.json [--numerics int8] [--threads 2]
        [--batches 1 2 4 8 16 32] [--rounds 5]

For each batch size B it prints the plain step (k = 0) and, for every node count k of the
profile's grid up to 8, the step time and the speedup over plain decoding if every sequence
verified the oracle tree of k nodes: ``B tau_opt(k) / T(B, k)`` over ``B / T(B, 0)``, with the
drafting free ("free") and at the profile's measured propose time per sequence ("drafted"). The
largest of these over k is an upper bound of what any budget can reach with that drafter: the
oracle knows which nodes will be accepted. Cases are interleaved over the rounds (medians; each
timed step follows an untimed one of its own shape); contexts of 150-243 cached tokens, chains
of k nodes packed as the batched engine packs them (B = 1 too: the single-request engine's own
step is a little faster, and its bound is the profile's oracle table). The "drafted" column
charges each sequence the profile's one-sequence propose time; heads that draft together
(the batched engine) cost less a sequence, so the truth lies between the two columns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specpilot.engine import Engine, EngineConfig
from specpilot.loading import load_model
from specpilot.tree import DraftTree
from specpilot.verify import VerifyRow, verify_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="a `specpilot profile --json` file")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--numerics", default="int8", choices=("fp32", "int8"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--max-nodes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with open(args.profile) as f:
        prof = json.load(f)
    tau = {int(e["n"]): float(e["tau"]) for e in prof["tau_opt"] if e["n"] <= args.max_nodes}
    draft_ms = {int(e["n"]): float(e["draft_ms"]) for e in prof["step_cost"]}
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    engine = Engine(loaded.model, EngineConfig(numerics=args.numerics))
    model, slots = loaded.model, 400
    model.setup_cache(slots, batch=max(args.batches), attention=engine.attention)
    cases = [(b, k) for b in args.batches for k in sorted(tau)]

    def rows(b: int, k: int) -> list[VerifyRow]:
        tree = DraftTree.chain([7 + j for j in range(k)], [0.0] * k) if k else DraftTree.empty()
        return [VerifyRow(100 + i, 150 + 3 * i, tree) for i in range(b)]

    def step(batch: list[VerifyRow]) -> float:
        t = time.perf_counter()
        verify_step(model, batch, (), cache_rows=slice(0, len(batch)), scratch=slots - 1,
                    packed=True)  # fmt: skip
        return time.perf_counter() - t

    times: dict[tuple[int, int], list[float]] = {c: [] for c in cases}
    with torch.inference_mode():
        for b, k in cases:  # warm-up
            step(rows(b, k))
        for _ in range(args.rounds):
            for b, k in cases:
                batch = rows(b, k)
                step(batch)  # once untimed: the case before may have been a 288-row step
                times[(b, k)].append(step(batch))
    med = {c: statistics.median(v) for c, v in times.items()}
    print(f"profile {args.profile}: drafter {prof.get('drafter')}, workload "
          f"{prof.get('workload')}; numerics={args.numerics} threads={args.threads} "
          f"rounds={args.rounds}")  # fmt: skip
    print(f"{'B':>3s} {'k':>3s} {'rows':>5s} {'step ms':>8s} {'tau_opt':>8s} {'free':>6s} "
          f"{'drafted':>8s}")  # fmt: skip
    for b in args.batches:
        plain = b / med[(b, 0)]
        best = (0.0, 0, 0.0)
        for k in sorted(tau):
            t = med[(b, k)]
            free = b * tau[k] / t / plain
            drafted = b * tau[k] / (t + b * draft_ms.get(k, 0.0) / 1e3) / plain
            best = max(best, (free, k, drafted))
            print(f"{b:3d} {k:3d} {b * (k + 1):5d} {1e3 * t:8.2f} {tau[k]:8.3f} {free:6.2f} "
                  f"{drafted:8.2f}")  # fmt: skip
        print(f"B={b}: bound {best[0]:.2f}x at {best[1]} nodes a sequence "
              f"({best[2]:.2f}x with its drafting)")  # fmt: skip


if __name__ == "__main__":
    main()
