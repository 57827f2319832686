"""Where a decoding step's time goes beyond the target forward: wall time per step of the engine's
parts (the verify forward, accepting, drafting and its parts, the goodput budget's choice and
bookkeeping), timed by wrappers around them, plain and speculative decoding of the same prompts
in turn. A diagnostic: the wrappers add ~1 us a call.

    python bench/step_breakdown.py [--temperature 1 --seed 0] --threads 2 --numerics int8 \\
        --workload chat --limit 10 --max-new-tokens 96

Takes ``specpilot bench``'s flags (the first candidate runs).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Any

import specpilot.engine as E
import specpilot.verify as V
from specpilot import cli
from specpilot.bench import generation
from specpilot.drafters.suffix import SuffixDrafter
from specpilot.drafters.union import UnionDrafter
from specpilot.goodput.selector import Selector
from specpilot.sampling import SamplingParams
from specpilot.workloads import load_workload

SECONDS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def timed(owner: Any, name: str, label: str) -> None:
    f = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SECONDS[label] += time.perf_counter() - t
            CALLS[label] += 1

    setattr(owner, name, wrapper)


def main() -> None:
    args = cli.build_parser().parse_args(["bench", *sys.argv[1:]])
    loaded, engine, cands, _ = cli._setup(args, hf_peers=False)
    tok, c = loaded.tokenizer, cands[0]
    parts = [
        (E.Engine, "step", "verify step"),
        (V, "forward", "  forward"),
        (V, "accept", "  accept"),
        (V, "build_inputs", "  inputs"),
        (V, "commit", "  commit"),
        (E, "_draft", "draft"),
        (UnionDrafter, "propose_batch", "  full drafts"),
        (UnionDrafter, "propose_cheap", "  cheap drafts"),
        (SuffixDrafter, "propose", "    suffix trees"),
        (Selector, "select", "  choice"),
        (Selector, "observe", "observe"),
    ]
    for owner, name, label in parts:
        timed(owner, name, label)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    gen = generation(args.max_new_tokens, True, sampling)
    prompts = load_workload(args.workload or "humaneval", limit=args.limit)
    enc = [tok.encode_prompt(p.text, chat=p.chat) for p in prompts]
    engine.generate(enc[0], gen, drafter=c.make_drafter(), spec=c.spec, eos_ids=tok.eos_ids)
    for mode in ("plain", "spec"):
        SECONDS.clear()
        CALLS.clear()
        steps, decode = 0, 0.0
        for ids in enc:
            drafter = c.make_drafter() if mode == "spec" else None
            r = engine.generate(ids, gen, drafter=drafter, spec=c.spec, eos_ids=tok.eos_ids)
            steps += r.steps
            decode += r.decode_s
        print(f"{mode}: {steps} steps, decoding {1e3 * decode / steps:.2f} ms a step")
        for _, _, k in parts:
            if CALLS[k]:
                per = 1e6 * SECONDS[k] / steps
                print(f"  {k:20s} {per:8.1f} us a step  ({CALLS[k]} calls)")


if __name__ == "__main__":
    main()
