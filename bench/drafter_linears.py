"""The shipped head drafter's linears as F16 blocks (fp32 numerics profile) against Q8_0 blocks
in the int8 profile (and oneDNN's bf16 GEMM where the CPU has one: what calls of many rows run
on), alternating, best of several rounds per shape and row count.

    python bench/drafter_linears.py [--rows 1 3 4 8 16] [--threads 2] [--rounds 5]

Builds the linears from the shipped drafter's config (random fp16-exact weights of its shapes);
prints microseconds per call and the sum over one forward's linears (fuse, in_proj, qkv, o,
gate_up, down). Needs the native kernels.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from specpilot.drafters.feature_net import _bf16_gemm, _Bf16Linear, _half_linear, _q8_linear

SHIPPED = Path(__file__).resolve().parents[1] / "src/specpilot/data/drafters/smollm2-135m-head"


def shapes() -> dict[str, tuple[int, int]]:
    """(out, in) of each linear of the shipped head (from its config.json)."""
    c = json.loads((SHIPPED / "config.json").read_text())
    d, hd, ff = c["dim"], c["head_dim"], c["intermediate_size"]
    return {
        "fuse": (d, len(c["taps"]) * d),
        "in_proj": (d, 2 * d),
        "qkv": ((c["n_heads"] + 2 * c["n_kv_heads"]) * hd, d),
        "o": (d, c["n_heads"] * hd),
        "gate_up": (2 * ff, d),
        "down": (d, ff),
    }


def best_us(fn, x: torch.Tensor, calls: int = 200) -> float:  # type: ignore[no-untyped-def]
    for _ in range(20):
        fn(x)
    t = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return 1e6 * (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 3, 4, 8, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    mods = {}
    for name, (out, k) in shapes().items():
        lin = nn.Linear(k, out, bias=False)
        with torch.no_grad():
            lin.weight.copy_((torch.randn(out, k, generator=g) * 0.02).half().float())
        kinds = [_half_linear(lin), _q8_linear(lin)]
        if _bf16_gemm():
            kinds.append(_Bf16Linear(lin.weight))
        mods[name] = tuple(kinds)
    print(f"threads={args.threads}; us per call, best of {args.rounds} alternating rounds")
    n = len(next(iter(mods.values())))
    head = ["F16", "Q8_0", "bf16"][:n]
    print(f"{'rows':>4s} {'linear':>8s} {'(out, in)':>12s} " + " ".join(f"{h:>8s}" for h in head)
          + f" {'F16/Q8_0':>8s}")  # fmt: skip
    for rows in args.rows:
        tot = [0.0] * n
        for name, kinds in mods.items():
            x = torch.randn(rows, kinds[0].in_features, generator=g)
            best = [float("inf")] * n
            for _ in range(args.rounds):
                for i, mod in enumerate(kinds):
                    best[i] = min(best[i], best_us(mod, x))
            tot = [a + b for a, b in zip(tot, best, strict=True)]
            shape = f"({kinds[0].out_features}, {kinds[0].in_features})"
            print(f"{rows:4d} {name:>8s} {shape:>12s} " + " ".join(f"{b:8.1f}" for b in best)
                  + f" {best[0] / best[1]:8.2f}")  # fmt: skip
        print(f"{rows:4d} {'all six':>8s} {'':>12s} " + " ".join(f"{b:8.1f}" for b in tot)
              + f" {tot[0] / tot[1]:8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
