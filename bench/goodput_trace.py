"""Per-step trace of the goodput budget on one request at a time: what it verified and accepted.

    python bench/goodput_trace.py --threads 2 --numerics int8 --limit 10 --max-new-tokens 128 \\
        [--drafter suffix] [--no-goodput --budget 4]

Takes ``specpilot bench``'s flags (the first candidate is traced; ``--temperature`` with
``--seed`` samples). Per prompt, plain and
speculative decoding interleaved (tokens asserted equal), then two digit strings, one digit per
step: draft nodes verified and draft tokens accepted (capped at 9). At the end: tokens per second
of both and their ratio (wall time of ``Engine.generate``, the goodput calibration included when
the curve is not cached yet: run twice), drafting seconds, the selector's summary and its
acceptance cells (regime, depth, probability bin): observations and acceptance rate.
"""

from __future__ import annotations

import sys
import time

from specpilot import cli
from specpilot.bench import generation
from specpilot.sampling import SamplingParams
from specpilot.workloads import load_workload


def main() -> None:
    args = cli.build_parser().parse_args(["bench", *sys.argv[1:]])
    loaded, engine, cands, _ = cli._setup(args, hf_peers=False)
    tok = loaded.tokenizer
    prompts = load_workload(args.workload or "humaneval", limit=args.limit)
    gen = generation(
        args.max_new_tokens,
        True,
        SamplingParams(args.temperature, args.top_k, args.top_p, args.seed),
    )
    c = cands[0]
    t_ar = t_sp = draft_s = 0.0
    n_tok = 0
    for p in prompts:
        ids = tok.encode_prompt(p.text, chat=p.chat)
        t = time.perf_counter()
        a = engine.generate(ids, gen, eos_ids=tok.eos_ids)
        t_ar += time.perf_counter() - t
        t = time.perf_counter()
        b = engine.generate(ids, gen, drafter=c.make_drafter(), spec=c.spec, eos_ids=tok.eos_ids)
        t_sp += time.perf_counter() - t
        assert a.tokens == b.tokens, f"{p.id}: speculative tokens differ from plain"
        n_tok += len(a.tokens)
        draft_s += b.draft_s
        plain = sum(n == 0 for n in b.draft_nodes)
        print(f"{p.id} steps {b.steps} plain {plain} tau {len(b.tokens) / b.steps:.2f}")
        print("  nodes", "".join(str(min(n, 9)) for n in b.draft_nodes))
        print("  acc  ", "".join(str(min(n, 9)) for n in b.accept_lengths))
    print(f"AR tok/s {n_tok / t_ar:.1f}  SP tok/s {n_tok / t_sp:.1f}  ratio {t_ar / t_sp:.3f}")
    print(f"drafting s {draft_s:.3f}")
    sel = engine.selector
    if sel is None:
        return
    s = sel.summary()
    print({k: v for k, v in s.items() if k != "curve"})
    print("curve ms", [round(x * 1e3, 2) for x in s["curve"]["seconds"]], "at", s["curve"]["rows"])
    for key in sorted(sel.stats.proposed):
        n = sel.stats.proposed[key]
        print(key, round(n, 1), round(sel.stats.accepted.get(key, 0.0) / n, 3))


if __name__ == "__main__":
    main()
