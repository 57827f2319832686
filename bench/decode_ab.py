"""Plain decoding under schedule settings switched at run time, alternating in one process (a
drifting machine moves every setting alike), with the layers' op time per forward.

    python bench/decode_ab.py --numerics int8 [--threads 2] [--limit 8] [--max-new-tokens 128]
        [--rounds 4] [--batch N] (--col-tile 8 64 | --prefetch 0 16 32)

Takes ``specpilot bench``'s flags (HumanEval, 8 prompts and 128 tokens unless given).
``--batch N``: batched plain decoding, N sequences at a time (forwards of N rows; all the prompts
per setting and round); else one sequence, the settings alternating prompt by prompt.
``--col-tile``: the column tile of every native linear's calls of that many rows (one row: the
one-row tile, else the multi-row one; 0 = the op's default); ``--prefetch``: the int8 GEMMs'
prefetch distance in columns (the ``kernel_prefetch`` mechanism). Prints per setting tokens per
second (prefill included), the median and mean time of the layers' op call
(``specpilot::lean_run``) per forward of N rows, and whether every setting decoded the same
tokens (it must: schedules keep the numerics contract).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from specpilot import kernels
from specpilot.batch import BatchEngine, BatchRequest, run_batch
from specpilot.bench_batch import batch_config_for
from specpilot.cli import _setup, build_parser
from specpilot.engine import GenerationConfig
from specpilot.kernels import int8, linear, stack
from specpilot.workloads import load_workload


def setters(model: Any, own: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """One callable per setting that puts it in force."""
    if own.col_tile:
        lins = [m for m in model.modules() if isinstance(m, kernels.GGUFLinear)]

        def tile(ct: int) -> Callable[[], None]:
            def put() -> None:
                for m in lins:  # past set_schedule's check: int8 tiles are not the fp32 kernel's
                    m.tiles = ((0, ct), m.tiles[1]) if own.batch == 1 else (m.tiles[0], (0, ct))
                linear._changed()

            return put

        return {f"col tile {ct}": tile(ct) for ct in own.col_tile}
    return {f"prefetch {c}": (lambda c=c: int8.set_prefetch(c)) for c in own.prefetch}


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--col-tile", type=int, nargs="+")
    what.add_argument("--prefetch", type=int, nargs="+")
    own, rest = ap.parse_known_args()
    args = build_parser().parse_args(["bench", *rest])
    loaded, engine, _, _ = _setup(args, hf_peers=False)
    tok = loaded.tokenizer
    prompts = load_workload(args.workload or "humaneval", limit=args.limit or 8)
    ids = [tok.encode_prompt(p.text, chat=p.chat) for p in prompts]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    beng = None
    if own.batch > 1:
        bcfg = batch_config_for(own.batch, ids, gen.max_new_tokens, 0)
        beng = BatchEngine(loaded.model, engine.cfg, bcfg, eos_ids=tok.eos_ids, detok=tok.decode)

    def decode(group: list[list[int]]) -> list[list[int]]:
        if beng is None:
            return [engine.generate(p, gen, eos_ids=tok.eos_ids).tokens for p in group]
        return [o.result.tokens for o in run_batch(beng, [BatchRequest(p, gen) for p in group])]

    put = setters(loaded.model, own)
    decode(ids[: own.batch])  # warm-up
    calls: dict[str, list[float]] = {k: [] for k in put}
    spent = dict.fromkeys(put, 0.0)
    made = dict.fromkeys(put, 0)
    tokens: dict[str, list[list[int]]] = {k: [] for k in put}
    run, cur = stack.run, [""]

    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = run(*a, **k)
        if a[1].shape[0] == own.batch:  # decode steps of the whole batch, not the prefills
            calls[cur[0]].append(time.perf_counter() - t)
        return out

    stack.run = timed  # type: ignore[assignment]
    names = list(put)
    groups = [[p] for p in ids] if beng is None else [ids]
    for r in range(own.rounds):
        for group in groups:
            for name in names if r % 2 == 0 else names[::-1]:
                put[name]()
                cur[0] = name
                t = time.perf_counter()
                got = decode(group)
                spent[name] += time.perf_counter() - t
                made[name] += sum(map(len, got))
                tokens[name] += got
    for name in names:
        one = calls[name]
        print(f"{name:14s} {made[name] / spent[name]:7.1f} tok/s   layers per {own.batch}-row "
              f"forward: median {1e3 * statistics.median(one):.3f} ms, mean "
              f"{1e3 * statistics.mean(one):.3f} ms ({len(one)} forwards)")  # fmt: skip
    same = all(tokens[n] == tokens[names[0]] for n in names)
    print(f"same tokens under every setting: {same}")


if __name__ == "__main__":
    main()
