"""Where a trained head's drafting step goes: torch.profiler around ``propose``.

    python bench/profile_head_drafter.py [--workload chat] [--limit 3] [--budget 32 --depth 8]
                                         [--numerics fp32|int8] [--no-goodput] [--dense-tables]

Decodes ``limit`` prompts with the shipped head drafter (the first one warms up), prints the
measured ``propose`` time per step and the profiler's operator table (the ``PROPOSE`` row's self
time is Python inside ``propose``). On native weights the head uses the target's GGUF embedding and
LM-head blocks in place; ``--dense-tables`` attaches their fp32 copies instead (the former path).
Figures in BENCHMARKS.md ("Trained drafters").
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from torch.profiler import ProfilerActivity, profile, record_function

from specpilot.costmodel.roofline import trained_net
from specpilot.engine import GenerationConfig
from specpilot.loading import load_model
from specpilot.loading.native import fp32_copy_bytes
from specpilot.runtime import build, default_plan
from specpilot.tree import TreeSpec
from specpilot.workloads import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default="head")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--numerics", default="fp32", choices=("fp32", "int8"))
    ap.add_argument("--no-goodput", action="store_true", help="draft at every step")
    ap.add_argument(
        "--dense-tables",
        action="store_true",
        help="share the target's embedding / LM head as fp32 copies (native weights)",
    )
    args = ap.parse_args()
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    prompts = load_workload(args.workload, limit=max(2, args.limit))
    spec = TreeSpec(kind="dynamic", budget=args.budget, topk=args.topk, depth=args.depth)
    plan = default_plan(loaded)
    engine = dataclasses.replace(plan.engine, numerics=args.numerics)
    if args.no_goodput:
        engine = dataclasses.replace(engine, goodput=False)
    built = build(plan.replace(drafter=args.drafter, tree=spec, engine=engine), loaded)
    drafter = built.make_drafter()
    head = trained_net(drafter)
    if args.dense_tables and head is not None:
        head.net.attach(loaded.model.model.embed_tokens.weight, loaded.model.head_weight())
        head.net.pack()
    inner = drafter.propose
    times: list[float] = []

    def propose(ctx):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        with record_function("PROPOSE"):
            tree = inner(ctx)
        times.append(time.perf_counter() - t)
        return tree

    drafter.propose = propose
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_on_eos=True)
    eos = tuple(tok.eos_ids)

    def run(p):  # type: ignore[no-untyped-def]
        ids = tok.encode_prompt(p.text, chat=p.chat)
        built.engine.generate(ids, gen, drafter=drafter, spec=built.spec, eos_ids=eos)

    run(prompts[0])  # warm-up
    times.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for p in prompts[1:]:
            run(p)
    print(f"propose: {1e3 * sum(times) / len(times):.1f} ms/step over {len(times)} steps")
    if loaded.model.native:
        print(f"fp32 copies of the target's tables: {fp32_copy_bytes(loaded.model) / 1e6:.1f} MB")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    main()
