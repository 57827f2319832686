"""Single-thread timings of the int8 GEMM's packed AVX-512 schedule (gemm_q8_vnni.h) built from
one or more checkouts, alternating build by build, with a check that every build writes the same
output bits. Below the op's dispatch, threads and quantization, so a kernel change shows even
where a whole forward's drift hides it.

    python bench/q8_kernel_ab.py [--src DIR ...] [--rounds 6] [--shape K N ROWS COPIES QTYPE ...]

``--src``: checkouts (default this one; e.g. a ``git worktree`` of the commit before). A shape is
k, n (columns, one core's share), rows, copies (weight tensors used in turn: 1 stays in the L2,
60 of SmolLM2's 576 x 1536 come from the L3 / memory) and the type (41 Q4_1, 80 Q8_0). Prints
the best microseconds per call of each build. Needs g++ and AVX-512 VNNI.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from specpilot.kernels.build import AVX512_FLAGS, COMMON_FLAGS

HERE = Path(__file__).resolve().parent
SHAPES = [  # SmolLM2-135M's linears, one core's half of the columns
    (576, 480, 1, 1, 41),  # q/k/v
    (576, 1536, 1, 1, 41),  # gate/up
    (1536, 288, 1, 1, 41),  # down
    (576, 24576, 1, 1, 80),  # LM head
    (576, 1536, 1, 30, 41),
    (576, 1536, 2, 1, 41),
    (576, 1536, 4, 1, 41),
    (576, 1536, 8, 1, 41),
    (576, 1536, 16, 1, 41),
    (1536, 288, 8, 1, 41),
    (640, 1024, 1, 1, 41),  # Gemma 3 270M's width: 4 trailing blocks
    (544, 1024, 4, 1, 41),  # one trailing block
]


def build(src: Path, out: Path) -> Path:
    csrc = src / "src" / "specpilot" / "kernels" / "csrc"
    if not (csrc / "gemm_q8_vnni.h").exists():
        sys.exit(f"error: {src} has no src/specpilot/kernels/csrc/gemm_q8_vnni.h")
    exe = out / f"bench_{len(list(out.iterdir()))}"
    cmd = ["g++", *COMMON_FLAGS, *AVX512_FLAGS, f"-I{csrc}", "-o", str(exe),
           str(HERE / "q8_kernel_bench.cpp")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: building against {csrc} failed:\n{done.stderr[-2000:]}")
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", nargs="+", type=Path, default=[HERE.parent])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--shape", nargs=5, type=int, action="append", metavar=("K", "N", "ROWS",
                    "COPIES", "QTYPE"))  # fmt: skip
    args = ap.parse_args()
    if "avx512_vnni" not in Path("/proc/cpuinfo").read_text():
        sys.exit("error: this CPU has no AVX-512 VNNI (the schedule timed here)")
    if args.rounds < 1:
        sys.exit("error: --rounds must be positive")
    shapes = [tuple(s) for s in args.shape] if args.shape else SHAPES
    with tempfile.TemporaryDirectory() as tmp:
        exes = [build(s.resolve(), Path(tmp)) for s in args.src]
        names = "  ".join(f"{s.resolve().name[:14]:>14s}" for s in args.src)
        print(f"k     n      rows copies type  {names}")
        same = True
        for shape in shapes:
            best = [float("inf")] * len(exes)
            hashes: set[str] = set()
            for _ in range(args.rounds):
                for i, exe in enumerate(exes):
                    out = subprocess.run([str(exe), *map(str, shape)], capture_output=True,
                                         text=True, check=True).stdout.split()  # fmt: skip
                    best[i] = min(best[i], float(out[0]))
                    hashes.add(out[1])
            same &= len(hashes) == 1
            k, n, rows, copies, qtype = shape
            name = {41: "Q4_1", 80: "Q8_0"}.get(qtype, str(qtype))
            cells = "  ".join(f"{b:11.2f} us" for b in best)
            print(f"{k:<5d} {n:<6d} {rows:<4d} {copies:<6d} {name:5s} {cells}"
                  + ("" if len(hashes) == 1 else "  DIFFERENT BITS"))  # fmt: skip
        print("same output bits in every build: " + ("yes" if same else "NO"))
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
