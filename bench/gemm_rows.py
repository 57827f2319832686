"""Time each native linear of layer 0 and the LM head by row count, AVX2 and AVX-512 paths
side by side (the same bits by the numerics contract), best of 30 calls (8 for the head).

    python bench/gemm_rows.py --numerics int8|fp32 [--threads 2] [--rows 1 2 3 4 6 8 16]
                              [--cold] [--only lm_head]

In the int8 profile the AVX2 path reads the blocks in GGUF order and the AVX-512 path in its
packed layout (each column re-lays the blocks). ``--cold``: a 64 MB buffer is written before
every call, so the weights come from memory as in a decode step (where the other layers' weights
evict them), and the median of the calls is printed instead of the best. ``--only``: the linears
whose name contains this.
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
    ap.add_argument("--cold", action="store_true", help="evict the caches before every call")
    ap.add_argument("--only", default="", help="only the linears whose name contains this")
    args = ap.parse_args()
    junk = torch.zeros(64 << 20, dtype=torch.uint8) if args.cold else None
    torch.set_num_threads(args.threads)
    loaded = load_model("smollm2-135m", weights="auto")
    Engine(loaded.model, EngineConfig(numerics=args.numerics))  # applies the numerics profile
    mods = {
        name: mod
        for name, mod in loaded.model.named_modules()
        if isinstance(mod, (GGUFLinear, GGUFMultiLinear))
        and ("layers.0." in name or "layers" not in name)
        and args.only in name
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
                    took = []
                    for _ in range(8 if "head" in name else 30):
                        if junk is not None:
                            junk.add_(1)
                        t = time.perf_counter()
                        mod(x)
                        took.append(time.perf_counter() - t)
                    mid = sorted(took)[len(took) // 2]
                    us.append(1e6 * (mid if junk is not None else min(took)))
                print(f"{name:32s} rows {rows:2d}  avx2 {us[0]:8.0f} us  avx512 {us[1]:8.0f} us")


if __name__ == "__main__":
    main()
