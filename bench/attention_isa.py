"""Time the batch-invariant attention op on its AVX2 and AVX-512 paths (the same bits), SmolLM2's
heads (9 query, 3 kv, head dim 64), alternating, best of 20 per path per round.

    python bench/attention_isa.py [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from specpilot import kernels

SHAPES = (
    ("1 row, 250 keys", 1, 250, False),
    ("8 causal rows, 250 keys", 8, 250, True),
    ("16 causal rows, 250 keys", 16, 250, True),
    ("128-row causal prefill", 128, 128, True),
)


def best(q, k, v, n, mask, isa: str) -> float:  # type: ignore[no-untyped-def]
    out = float("inf")
    for _ in range(20):
        t = time.perf_counter()
        kernels.fixed_attention(q, k, v, n, mask, None, isa)
        out = min(out, time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    for name, t, n, causal in SHAPES:
        q = torch.randn(1, 9, t, 64, generator=g)
        k, v = torch.randn(1, 3, n, 64, generator=g), torch.randn(1, 3, n, 64, generator=g)
        mask = None
        if causal:
            mask = (torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None])[None]
        ratios = []
        for _ in range(args.rounds):
            a2, a5 = best(q, k, v, n, mask, "avx2"), best(q, k, v, n, mask, "avx512")
            ratios.append(f"{a2 * 1e6:.1f} / {a5 * 1e6:.1f} us ({a5 / a2:.2f}x)")
        print(f"{name:26s} avx2 / avx512: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
