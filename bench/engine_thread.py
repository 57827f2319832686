"""Batched steps in the main thread against the same steps in a worker thread, alternating in one
process: what ``specpilot serve`` paid while its engine ran in a worker thread (libgomp keeps a
thread pool per thread that starts parallel regions; with two pools on a machine with as many
cores as one pool's threads its threads barely spin before sleeping, and every parallel region
waits for them to wake; :mod:`specpilot.server.scheduler`).

    python bench/engine_thread.py --threads 2 --numerics int8 [--batch 8] [--rounds 3]

Takes ``specpilot bench``'s flags; plain decoding of ``--batch`` HumanEval prompts, prefill and
``--steps`` batched steps per round and thread. Prints the prefill seconds and the mean step
milliseconds of each; the worker is a fresh thread each round, as the server's was one thread
for its whole life (the slowdown is per parallel region, not per thread start).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

from specpilot.batch import BatchEngine, BatchRequest
from specpilot.bench_batch import batch_config_for
from specpilot.cli import _setup, build_parser
from specpilot.engine import GenerationConfig
from specpilot.workloads import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    own, rest = ap.parse_known_args(sys.argv[1:])
    args = build_parser().parse_args(["bench", "--drafter", "none", *rest])
    loaded, engine, _, _ = _setup(args)
    tok = loaded.tokenizer
    prompts = load_workload(args.workload or "humaneval", limit=own.batch)
    ids = [tok.encode_prompt(p.text, chat=p.chat) for p in prompts]
    gen = GenerationConfig(max_new_tokens=own.steps + 8)
    bcfg = batch_config_for(own.batch, ids, gen.max_new_tokens, 0)
    beng = BatchEngine(loaded.model, engine.cfg, bcfg, eos_ids=tok.eos_ids, detok=tok.decode)

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in ids:
            beng.add(BatchRequest(i, gen, None, None))
        t1 = time.perf_counter()
        n = 0
        while beng.slots and n < own.steps:
            beng.step()
            n += 1
        t2 = time.perf_counter()
        for s in list(beng.slots):
            beng.remove(s)
        return t1 - t0, (t2 - t1) / max(n, 1)

    def in_worker() -> tuple[float, float]:
        out: list[tuple[float, float]] = []
        th = threading.Thread(target=lambda: out.append(once()))
        th.start()
        th.join()
        return out[0]

    once()  # warm-up
    print(f"batch {own.batch}, {own.steps} steps a round")
    for r in range(own.rounds):
        for name, fn in (("main", once), ("worker", in_worker)):
            pre, step = fn()
            print(f"round {r}  {name:6s}  prefill {pre:.2f} s  step {1e3 * step:.2f} ms")


if __name__ == "__main__":
    main()
