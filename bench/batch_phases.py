"""Batched plain vs speculative decoding in interleaved rounds, with the time of each phase of
``BatchEngine.step`` (drafting, the verify forward, the budget's bookkeeping) per mode.

    python bench/batch_phases.py BATCH --threads 2 --workload chat --numerics int8 \\
        [--max-new-tokens 128] [--rounds 3] [--server-like] [--node-steps] [--decisions]

Takes ``specpilot bench``'s flags after the batch size; 32 prompts. ``--server-like`` leaves the
queue length unknown at every step, as ``specpilot serve`` does. ``--node-steps`` also prints
every speculative step that verified draft nodes: sequences, rows, the selector's predicted and
the measured verify ms, its curve's plain step for that many sequences, and the tokens it
predicted and the step committed. ``--decisions`` also counts the speculative steps by what
drafted (nothing, the cheap tier alone, the full drafter as a probe or every step, or both) with
their drafting seconds and how many of them verified nodes. A diagnostic (it patches the
engine's methods with timers); totals include prefill.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

from specpilot import batch as batch_mod
from specpilot.batch import BatchEngine, BatchRequest, run_batch
from specpilot.bench_batch import batch_config_for
from specpilot.cli import _setup, build_parser
from specpilot.engine import GenerationConfig
from specpilot.goodput.selector import Selector
from specpilot.workloads import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("batch", type=int)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-like", action="store_true")
    ap.add_argument("--node-steps", action="store_true")
    ap.add_argument("--decisions", action="store_true")
    own, rest = ap.parse_known_args(sys.argv[1:])
    args = build_parser().parse_args(["bench", "--batch-size", str(own.batch), *rest])
    loaded, engine, cands, _ = _setup(args)
    tok, c = loaded.tokenizer, cands[0]
    prompts = load_workload(args.workload or "humaneval", limit=32)
    ids = [tok.encode_prompt(p.text, chat=p.chat) for p in prompts]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    bcfg = batch_config_for(own.batch, ids, args.max_new_tokens, c.spec.max_nodes)
    beng = BatchEngine(loaded.model, engine.cfg, bcfg, eos_ids=tok.eos_ids, detok=tok.decode)
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

    node_steps: list[tuple[int, int, float, float, float, float, int]] = []
    if own.node_steps:
        observe = Selector.observe

        def logged(self, trees, paths, *a, **k):  # type: ignore[no-untyped-def]
            observe(self, trees, paths, *a, **k)
            if any(t.size for t in trees):
                b, rows, pred, act = self.log[-1]
                node_steps.append((b, rows, 1e3 * pred, 1e3 * act, 1e3 * self.curve(b),
                                   self.last.predicted_tokens, b + sum(map(len, paths))))

        Selector.observe = logged  # type: ignore[method-assign]
    decisions: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    if own.decisions:
        should, tier, propose = Selector.should_draft, Selector.cheap_tier, BatchEngine._propose
        asked: dict[str, bool] = {}

        def should_draft(self, batch=1):  # type: ignore[no-untyped-def]
            asked["full"] = full = should(self, batch)
            asked["probe"] = full and self.probing
            return full

        def cheap_tier(self, batch=1):  # type: ignore[no-untyped-def]
            asked["cheap"] = got = tier(self, batch)
            return got

        def counted(self):  # type: ignore[no-untyped-def]
            asked.clear()
            t = time.perf_counter()
            trees = propose(self)
            if cur[0] != "spec":
                return trees
            kind = ("probe" if asked.get("probe") else "full" if asked.get("full") else "none")
            kind += "+cheap" if asked.get("cheap") else ""
            row = decisions[kind]
            row[0] += 1
            row[1] += time.perf_counter() - t
            row[2] += any(tr.size for tr in trees)
            return trees

        Selector.should_draft = should_draft  # type: ignore[method-assign]
        Selector.cheap_tier = cheap_tier  # type: ignore[method-assign]
        BatchEngine._propose = counted  # type: ignore[method-assign]
    timed(BatchEngine, "_propose", "propose")
    timed(batch_mod, "verify_step", "verify")
    timed(Selector, "observe", "observe")
    timed(BatchEngine, "step", "step")
    timed(BatchEngine, "add", "add")
    timed(BatchEngine, "remove", "remove")
    if own.server_like:
        step = BatchEngine.step

        def unknown_queue(self):  # type: ignore[no-untyped-def]
            self.waiting = None
            return step(self)

        BatchEngine.step = unknown_queue  # type: ignore[method-assign]
    total: dict[str, float] = defaultdict(float)
    for _ in range(own.rounds):
        for mode in ("plain", "spec"):
            cur[0] = mode
            spec = mode == "spec"
            reqs = [BatchRequest(i, gen, c.make_drafter() if spec else None,
                                 c.spec if spec else None) for i in ids]  # fmt: skip
            t = time.perf_counter()
            run_batch(beng, reqs)
            total[mode] += time.perf_counter() - t
    for mode, t in total.items():
        parts = {k: f"{v:.3f}" for (m, k), v in spent.items() if m == mode}
        print(f"{mode:5s} total {t:.2f} s  {parts}")
    if own.decisions:
        print("speculative steps by what drafted: steps, drafting s, steps that verified nodes")
        for kind, (n, sec, nodes) in sorted(decisions.items()):
            print(f"  {kind:12s} {n:6d} {sec:8.3f} {nodes:6d}")
    if own.node_steps:
        print("node steps: sequences, rows, predicted / measured / plain ms, predicted / "
              "committed tokens")
        for b, rows, pred, act, plain, want, got in node_steps:
            print(f"{b:3d} {rows:4d} {pred:7.1f} {act:7.1f} {plain:7.1f} {want:7.2f} {got:4d}")


if __name__ == "__main__":
    main()
