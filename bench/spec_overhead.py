"""Speculation's fixed cost per step with no node verified: plain decoding against speculative
decoding whose every selected tree is replaced by an empty one (drafting, the budget and the
head's taps all run; nothing is verified), interleaved per prompt, with the time of the drafting
call, the verify step and the budget's bookkeeping per step.

    python bench/spec_overhead.py --threads 2 --numerics int8 [--workload chat] \\
        [--temperature 1] [--limit 10] [--max-new-tokens 96] [--rounds 3]

Takes ``specpilot bench``'s flags; also runs ``--drafter suffix`` beside the plan's drafter. A
diagnostic (it patches the engine's functions with timers), not a figure of the engine's speed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

from specpilot import cli
from specpilot import engine as E
from specpilot.engine import Engine, GenerationConfig
from specpilot.goodput import selector as S
from specpilot.plan_setup import setup
from specpilot.tree import DraftTree
from specpilot.workloads import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--rounds", type=int, default=3)
    own, rest = ap.parse_known_args(sys.argv[1:])
    args = cli.build_parser().parse_args(["bench", *rest])
    loaded, engine, cands, _ = cli._setup(args, hf_peers=False)
    s2 = setup(cli.build_parser().parse_args(["bench", *rest, "--drafter", "suffix"]), False)
    eng2, cand2 = s2.engine, s2.candidates[0]
    tok, c = loaded.tokenizer, cands[0]
    prompts = load_workload(args.workload or "chat", limit=args.limit or 10)
    enc = [tok.encode_prompt(p.text, chat=p.chat) for p in prompts]
    spent: dict[tuple[str, str], float] = defaultdict(float)
    cur = [""]

    def timed(obj: object, name: str, key: str) -> None:
        f = getattr(obj, name)

        def g(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            r = f(*a, **k)
            spent[(cur[0], key)] += time.perf_counter() - t
            return r

        setattr(obj, name, g)

    timed(E, "_draft", "draft")
    timed(Engine, "step", "step")
    timed(S.Selector, "observe", "observe")
    select = S.Selector.select

    def empty_select(self, trees, *a, **k):  # type: ignore[no-untyped-def]
        return [DraftTree.empty() for _ in select(self, trees, *a, **k)]

    S.Selector.select = empty_select  # type: ignore[method-assign]
    temp = args.temperature
    steps: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    for _ in range(own.rounds):
        for i, ids in enumerate(enc):
            gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=temp, seed=i)
            for mode in ("plain", "zero-nodes", "zero-nodes suffix", "plain again"):
                cur[0] = mode
                t0 = time.perf_counter()
                if mode.startswith("plain"):
                    r = engine.generate(ids, gen, eos_ids=tok.eos_ids)
                elif mode == "zero-nodes":
                    r = engine.generate(ids, gen, drafter=c.make_drafter(), spec=c.spec,
                                        eos_ids=tok.eos_ids)  # fmt: skip
                else:
                    r = eng2.generate(ids, gen, drafter=cand2.make_drafter(), spec=cand2.spec,
                                      eos_ids=tok.eos_ids)  # fmt: skip
                total[mode] += time.perf_counter() - t0
                steps[mode] += r.steps
    for mode, t in total.items():
        parts = {k: f"{1e3 * v / steps[mode]:.3f}" for (m, k), v in spent.items() if m == mode}
        print(f"{mode:18s} ms/step {1e3 * t / steps[mode]:.3f}  {parts}")


if __name__ == "__main__":
    main()
