"""Drafting time of the default plan's head+suffix drafter in the batch engine: the full drafts of a
step asked together (``propose_all``: heads over one net run one forward per depth for all
sequences) against the same drafts asked one sequence at a time. Drafts every step (no goodput
budget), so both modes draft the same trees; their tokens must be equal.

    python bench/head_batch.py [--batch 4] [--workload humaneval] [--rounds 3] [--max-new-tokens 64]

Per mode: the median drafting milliseconds of a batch step, for the steady steps (the head feeds
the last step's committed entries) and the first step after admission (the prompt catch-up).
The modes alternate, ``--rounds`` times each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import specpilot.batch as batch_mod
from specpilot.batch import BatchEngine, BatchRequest, run_batch
from specpilot.bench_batch import batch_config_for
from specpilot.cli import _setup, build_parser
from specpilot.drafters.base import propose_all
from specpilot.engine import GenerationConfig
from specpilot.workloads import load_workload


def _one_by_one(drafters, ctxs):  # type: ignore[no-untyped-def]
    return [d.propose(c) for d, c in zip(drafters, ctxs, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    bench_args = build_parser().parse_args(
        ["bench", "--threads", "2", "--numerics", "int8", "--workload", args.workload]
    )
    loaded, engine, cands, _ = _setup(bench_args, hf_peers=False)
    tok, cand = loaded.tokenizer, cands[0]
    prompts = load_workload(args.workload, limit=args.batch)
    enc = [tok.encode_prompt(p.text, chat=p.chat) for p in prompts]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_on_eos=False)
    bcfg = batch_config_for(args.batch, enc, args.max_new_tokens, cand.spec.max_nodes)
    beng = BatchEngine(loaded.model, replace(engine.cfg, goodput=False), bcfg, eos_ids=tok.eos_ids)
    modes = {"together": propose_all, "one by one": _one_by_one}
    times: dict[str, list[float]] = {m: [] for m in modes}
    first: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds + 1):  # round 0 warms both modes
        for name, fn in modes.items():
            calls: list[float] = []

            def timed(drafters, ctxs, fn=fn, calls=calls):  # type: ignore[no-untyped-def]
                t = time.perf_counter()
                out = fn(drafters, ctxs)
                calls.append(time.perf_counter() - t)
                return out

            batch_mod.propose_all = timed  # type: ignore[assignment]
            reqs = [BatchRequest(ids, gen, cand.make_drafter(), cand.spec) for ids in enc]
            outs = run_batch(beng, reqs)
            batch_mod.propose_all = propose_all
            got = [o.result.tokens for o in outs]
            assert tokens.setdefault(name, got) == got, "a mode's tokens changed between rounds"
            if r:
                first[name].append(calls[0])
                times[name].extend(calls[1:])
    same = tokens["together"] == tokens["one by one"]
    print(f"batch {args.batch}, {args.workload}, {args.max_new_tokens} tokens, "
          f"{args.rounds} rounds; tokens equal between modes: {same}")
    for name in modes:
        print(f"{name:>10}: steady {1e3 * statistics.median(times[name]):.2f} ms/step "
              f"({len(times[name])} steps), catch-up {1e3 * statistics.median(first[name]):.2f} ms")


if __name__ == "__main__":
    main()
