"""Time each native linear of layer 0 and the LM head by row count, AVX2 and AVX-512 paths
side by side (the same bits by the numerics contract), best of 30 calls (8 for the head).

    python bench/gemm_rows.py --numerics int8|fp32 [--threads 2] [--rows 1 2 3 4 6 8 16]
"""

from __future__ import annotations

import argparse
import time

import torch

from specpilot.engine import Engine, EngineConfig
from specpilot.kernels.linear import GGUFLinear, GGUFMultiLinear
from specpilot.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numerics", default="fp32", choices=("fp32", "int8"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m", weights="auto")
    Engine(loaded.model, EngineConfig(numerics=args.numerics))  # applies the numerics profile
    mods = {
        name: mod
        for name, mod in loaded.model.named_modules()
        if isinstance(mod, (GGUFLinear, GGUFMultiLinear))
        and ("layers.0." in name or "layers" not in name)
    }

    def set_isa(mod: torch.nn.Module, code: int) -> None:
        for sub in mod.modules():
            if isinstance(sub, GGUFLinear):
                sub.isa = code

    with torch.inference_mode():
        for name, mod in mods.items():
            first = next(m for m in mod.modules() if isinstance(m, GGUFLinear))
            for rows in args.rows:
                x = torch.randn(rows, first.in_features)
                us = []
                for code in (2, 3):  # linear.ISAS: avx2, avx512
                    set_isa(mod, code)
                    mod(x)
                    best = float("inf")
                    for _ in range(8 if "head" in name else 30):
                        t = time.perf_counter()
                        mod(x)
                        best = min(best, time.perf_counter() - t)
                    us.append(best * 1e6)
                print(f"{name:32s} rows {rows:2d}  avx2 {us[0]:8.0f} us  avx512 {us[1]:8.0f} us")


if __name__ == "__main__":
    main()
