"""The single-request goodput budget's cost curve against the steps it verifies: every
``--every`` steps, the curve at 1-5 rows and the live median step time per row count (and how
many steps of each) over the window since the last print.

    python bench/curve_trace.py [--threads 2] [--numerics int8] [--workload humaneval]
        [--limit 16] [--max-new-tokens 128] [--every 150]

The default plan, speculative, one prompt after another; ``Engine.step`` is timed from outside
(the time the budget itself observes). A row count the budget stops choosing shows no live
steps in later windows; its curve point then shows what the curve holds for it.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from specpilot.cli import build_parser
from specpilot.engine import Engine, GenerationConfig
from specpilot.plan_setup import setup
from specpilot.workloads import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--numerics", default="int8", choices=("fp32", "int8"))
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--every", type=int, default=150)
    args = ap.parse_args()
    cli = build_parser().parse_args(["bench", "--threads", str(args.threads), "--numerics",
                                     args.numerics, "--workload", args.workload])  # fmt: skip
    s = setup(cli)
    eng, cand, tok = s.engine, s.candidates[0], s.loaded.tokenizer
    work = load_workload(args.workload, limit=args.limit)
    prompts = [tok.encode_prompt(p.text, chat=p.chat) for p in work]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    window: dict[int, list[float]] = collections.defaultdict(list)
    steps = [0]
    step = Engine.step

    def timed(self, root, cache_len, tree, taps=(), sampler=None):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = step(self, root, cache_len, tree, taps, sampler)
        window[tree.size + 1].append(time.perf_counter() - t)
        steps[0] += 1
        sel = getattr(self, "selector", None)
        if steps[0] % args.every == 0 and sel is not None:
            curve = [round(1e3 * sel.curve(r), 2) for r in range(1, 6)]
            live = {r: (round(1e3 * statistics.median(v), 2), len(v))
                    for r, v in sorted(window.items()) if r <= 5}  # fmt: skip
            print(f"step {steps[0]}: curve at 1-5 rows {curve}; live median ms, steps {live}")
            window.clear()
        return out

    Engine.step = timed  # type: ignore[method-assign]
    for ids in prompts:
        eng.generate(ids, gen, drafter=cand.make_drafter(), spec=cand.spec, eos_ids=tok.eos_ids)


if __name__ == "__main__":
    main()
