"""Where a single request's decode loop spends its time, plain against speculative decoding,
interleaved per prompt: per step the verify step, the drafting call (full drafts split into
catch-ups and steady drafts, a tiered drafter's cheap part alone), the budget's choice and
bookkeeping, the rest of the loop, and what lies outside the loop (prefill).

    python bench/loop_phases.py --threads 2 --numerics int8 [--workload chat] \\
        [--temperature 1 --seed 0] [--limit 10] [--max-new-tokens 96] [--rounds 2]

Takes ``specpilot bench``'s flags (the plan's first candidate). A diagnostic: it wraps the
engine's and the selector's functions with timers, so its times are a little above a bench's;
read the differences between the two modes, not the absolute times. Every speculative output is
checked against the plain one of the same prompt and round.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from specpilot import cli
from specpilot import engine as E
from specpilot.drafters import union as U
from specpilot.engine import Engine, GenerationConfig
from specpilot.goodput import selector as S
from specpilot.workloads import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--rounds", type=int, default=2)
    own, rest = ap.parse_known_args(sys.argv[1:])
    args = cli.build_parser().parse_args(["bench", *rest])
    loaded, engine, cands, _ = cli._setup(args, hf_peers=False)
    tok, c = loaded.tokenizer, cands[0]
    prompts = load_workload(args.workload or "humaneval", limit=args.limit or 10)
    enc = [tok.encode_prompt(p.text, chat=p.chat) for p in prompts]
    spent: dict[tuple[str, str], float] = defaultdict(float)
    counts: dict[tuple[str, str], int] = defaultdict(int)
    mode = [""]

    def timed(obj: object, name: str, key: str) -> None:
        f: Callable[..., Any] = getattr(obj, name)

        def g(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            r = f(*a, **k)
            spent[(mode[0], key)] += time.perf_counter() - t
            return r

        setattr(obj, name, g)

    note_draft = S.Selector.note_draft

    def by_kind(self: S.Selector, seconds: float, sequences: int = 1, cheap: bool = False,
                catchup: bool | None = None) -> None:  # fmt: skip
        caught = self.idle > 0 or self._fresh if catchup is None else catchup
        kind = "cheap" if cheap else "catch-up" if caught else "steady"
        spent[(mode[0], kind)] += seconds
        counts[(mode[0], kind)] += 1
        note_draft(self, seconds, sequences, cheap, catchup)

    S.Selector.note_draft = by_kind  # type: ignore[method-assign]
    timed(E, "_draft", "draft")
    timed(Engine, "step", "step")
    timed(S.Selector, "select", "select")
    timed(S.Selector, "observe", "observe")
    timed(S.Selector, "should_draft", "should_draft")
    timed(U.UnionDrafter, "propose_cheap", "propose_cheap")
    steps: dict[str, int] = defaultdict(int)
    decode: dict[str, float] = defaultdict(float)
    total: dict[str, float] = defaultdict(float)
    mismatches = 0
    for _ in range(own.rounds):
        for i, ids in enumerate(enc):
            gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   seed=i)  # fmt: skip
            outs = {}
            for m in ("plain", "spec"):
                mode[0] = m
                t = time.perf_counter()
                if m == "plain":
                    r = engine.generate(ids, gen, eos_ids=tok.eos_ids)
                else:
                    r = engine.generate(ids, gen, c.make_drafter(), c.spec, eos_ids=tok.eos_ids)
                total[m] += time.perf_counter() - t
                steps[m] += r.steps
                decode[m] += r.decode_s
                outs[m] = r.tokens
            mismatches += outs["plain"] != outs["spec"]
    for m in ("plain", "spec"):
        n = max(steps[m], 1)

        def ms(x: float, n: int = n) -> str:
            return f"{1e3 * x / n:.3f}"

        step, draft = spent[(m, "step")], spent[(m, "draft")]
        print(f"{m}: {steps[m]} steps, ms a step: total {ms(total[m])}, decode {ms(decode[m])} "
              f"(verify step {ms(step)}, drafting call {ms(draft)}, rest of the loop "
              f"{ms(decode[m] - step - draft)}), outside the loop {ms(total[m] - decode[m])}")
        parts = {k: ms(v) for (mm, k), v in spent.items() if mm == m and k not in ("step", "draft")}
        drafts = {k: v for (mm, k), v in counts.items() if mm == m}
        if parts:
            print(f"  of which: {parts}; drafts {drafts}")
    print(f"speculative outputs different from plain: {mismatches}")


if __name__ == "__main__":
    main()
