"""Acceptance of X+suffix settings without timing: tau, trained-drafter calls, verified nodes.

    python bench/union_tau.py --workload humaneval --limit 8 --max-new-tokens 128 \
        --tree chain --k 5 --setting 0:0 --setting 4:0 --setting 4:3

Each ``--setting TRUST:DEPTH[:MIN_PROB]`` is a :class:`UnionDrafter` (``trust``,
``trained_depth``) over the shipped head (``min_prob``); ``suffix`` alone is the reference. Every
output is checked against plain decoding. Counts do not depend on machine load, so this runs
beside other jobs; speed is measured with ``specpilot bench`` (``--union-trust``,
``--union-depth``, ``--head-min-prob``).
"""

from __future__ import annotations

import argparse

from specpilot.drafters import make_drafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.loading import load_model
from specpilot.tree import TreeSpec
from specpilot.workloads import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="head", help="trained drafter: head or DIR")
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", default="chain")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--numerics", default="fp32", choices=("fp32", "int8"))
    ap.add_argument("--setting", action="append", default=[], help="TRUST:DEPTH[:MIN_PROB]")
    args = ap.parse_args()
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    engine = Engine(loaded.model, EngineConfig(numerics=args.numerics))
    spec = TreeSpec(kind=args.tree, k=args.k, budget=args.budget, topk=args.topk, depth=args.depth)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_on_eos=True)
    eos = tuple(tok.eos_ids)
    prompts = [tok.encode_prompt(p.text, chat=p.chat) for p in load_workload(args.workload)]
    prompts = prompts[: args.limit]
    refs = [engine.generate(ids, gen, eos_ids=eos).tokens for ids in prompts]
    rows = [("suffix", lambda: make_drafter("suffix"))]
    for s in args.setting:
        parts = s.split(":")
        trust, depth = int(parts[0]), int(parts[1])
        mp = float(parts[2]) if len(parts) > 2 else 0.0
        name = f"{args.drafter}+suffix"
        rows.append(
            (
                f"{name} trust={trust} depth={depth or 'spec'} min_prob={mp}",
                lambda t=trust, d=depth, n=name, p=mp: make_drafter(
                    n, target=loaded, trust=t, trained_depth=d, min_prob=p
                ),
            )
        )
    print(f"{args.workload} x {len(prompts)}, {args.tree} {spec}")
    print(f"{'drafter':52s} {'tau':>5s} {'calls':>6s} {'fwd/step':>8s} {'nodes':>6s} identical")
    for label, make in rows:
        d = make()
        steps = acc = nodes = same = 0
        for ids, ref in zip(prompts, refs, strict=True):
            res = engine.generate(ids, gen, drafter=d, spec=spec, eos_ids=eos)
            steps += res.steps
            acc += sum(res.accept_lengths)
            nodes += sum(res.draft_nodes)
            same += res.tokens == ref
        calls = steps - d.copy_steps if hasattr(d, "copy_steps") else 0
        fwd = d.trained.forwards if hasattr(d, "trained") else 0
        print(
            f"{label:52s} {(acc + steps) / steps:5.2f} {calls / steps:6.2f} {fwd / steps:8.2f} "
            f"{nodes / steps:6.2f} {same}/{len(prompts)}"
        )


if __name__ == "__main__":
    main()
