"""Where a process's CPU time went, per thread, from a ``perf record -e cpu-clock`` of it: the
share of each thread's samples in the int8 GEMMs, attention, OpenMP's waits (libgomp: a thread
idle at a join or between parallel regions), glibc, torch + Python, and the rest, over the last
seconds of the recording (a timing loop after the model load).

    perf record -e cpu-clock -F 4000 -o perf.data -- python bench/step_cost.py --numerics int8 \\
        --context 200 --rows 1 --repeats 800
    python bench/perf_split.py perf.data [--last 3]

Needs ``perf`` (software clock events: no hardware counters); a recording without ``-g`` (one
line per sample). A diagnostic of the serial work
between parallel regions (one thread busy, the other waiting) and of kernel time per class.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict

CLASSES = (  # first match wins
    ("gemm", re.compile(r"pcolumns|tcolumns|sp_gemm|columns<")),
    ("attention", re.compile(r"scores<|tile<|attention|weighted|softmax_weights|visible")),
    ("omp wait", re.compile(r"libgomp")),
    ("glibc", re.compile(r"/libc\.so|libc-")),
    ("torch+python", re.compile(r"libpython|libtorch|_Py|site-packages/torch")),
    ("other kernels", re.compile(r"specpilot_kernels")),
)


def classify(line: str) -> str:
    for name, pattern in CLASSES:
        if pattern.search(line):
            return name
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", help="a perf.data file")
    ap.add_argument("--last", type=int, default=3, help="seconds before the last one to read")
    args = ap.parse_args()
    if shutil.which("perf") is None:
        sys.exit("error: perf is not installed")
    if args.last < 1:
        sys.exit("error: --last must be positive")
    done = subprocess.run(["perf", "script", "-i", args.data, "-F", "tid,time,ip,sym,dso"],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"error: perf script failed: {done.stderr.strip()[-300:]}")
    rows = []
    for line in done.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[1].rstrip(":").replace(".", "").isdigit():
            rows.append((int(parts[0]), float(parts[1].rstrip(":")), parts[2]))
    if not rows:
        sys.exit("error: no samples in " + args.data)
    end = int(max(t for _, t, _ in rows))
    lo, hi = end - args.last, end - 1  # whole seconds, the partial last one left out
    by_thread: dict[int, Counter[str]] = defaultdict(Counter)
    for tid, t, rest in rows:
        if lo <= int(t) <= hi:
            by_thread[tid][classify(rest)] += 1
    names = [n for n, _ in CLASSES] + ["other"]
    print(f"{'thread':>8s} {'samples':>8s}  " + "  ".join(f"{n:>13s}" for n in names))
    for tid, c in sorted(by_thread.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(c.values())
        if total < 0.05 * args.last * 1000:  # helper threads that barely ran
            continue
        cells = "  ".join(f"{100 * c[n] / total:12.1f}%" for n in names)
        print(f"{tid:>8d} {total:>8d}  {cells}")


if __name__ == "__main__":
    main()
