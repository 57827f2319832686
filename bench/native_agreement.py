"""How often native GGUF greedy tokens equal the fp32 path's, and at which margin they differ.

    python bench/native_agreement.py [--model smollm2-135m] [--limit 20] [--max-new-tokens 64]

Both sides decode the same prompts greedily with plain decoding: ``fp32`` is the dequantized model
(``weights="fp32"``, fp64 ``exact`` attention, oneDNN), whose greedy tokens equal Hugging Face
transformers' fp32 greedy tokens (tests/test_hf_parity.py, bench/gemma_parity.py); ``native``
runs the file's blocks (``weights="native"``, the engine's default attention). Native weights
are exactly the dequantized values, but their sums run in another order, so near-ties may flip;
this reports where. For each prompt (the first ``--limit`` of each ``--workloads``) it records
whether the tokens are identical, the first differing position, and there the top-1 minus top-2
logit of both models after the common prefix (a small fp32 margin: a near-tie). Not a speed
benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.loading import load_model
from specpilot.model import Transformer, causal_mask
from specpilot.workloads import load_workload


def margin_after(model: Transformer, ids: list[int]) -> tuple[int, float]:
    """(argmax, top-1 minus top-2 logit) of ``model`` after ``ids`` (one causal forward)."""
    t = len(ids)
    model.setup_cache(t + 1, attention="exact")
    with torch.no_grad():
        mask = causal_mask(0, t, t, model.device)
        out = model(torch.tensor([ids]), torch.arange(t)[None], 0, t, mask=mask,
                    logits_rows=slice(t - 1, t))  # fmt: skip
    assert out.logits is not None
    top = torch.topk(out.logits[0, -1].float(), 2)
    return int(top.indices[0]), float(top.values[0] - top.values[1])


def compare(ref: list[int], nat: list[int]) -> int | None:
    """The first position where the two token lists differ (None: identical)."""
    for i, (a, b) in enumerate(zip(ref, nat, strict=False)):
        if a != b:
            return i
    return None if len(ref) == len(nat) else min(len(ref), len(nat))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", nargs="+", default=["humaneval", "chat"])
    ap.add_argument("--limit", type=int, default=20, help="prompts per workload (default 20)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args()
    t0 = time.time()
    fp32 = load_model(args.model, weights="fp32")
    nat = load_model(args.model, weights="native")
    if not nat.model.native:
        print(f"native weights unavailable: {'; '.join(nat.notes)}", file=sys.stderr)
        return 2
    engines = {"fp32": Engine(fp32.model, EngineConfig(attention="exact", linear="onednn")),
               "native": Engine(nat.model, EngineConfig())}  # fmt: skip
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_on_eos=False)
    tok = fp32.tokenizer
    rows: list[dict[str, Any]] = []
    for workload in args.workloads:
        for p in load_workload(workload, limit=args.limit):
            ids = tok.encode_prompt(p.text, chat=p.chat)
            out = {k: e.generate(ids, gen).tokens for k, e in engines.items()}
            div = compare(out["fp32"], out["native"])
            row: dict[str, Any] = {"id": p.id, "workload": workload, "prompt_tokens": len(ids),
                                   "identical": div is None, "first_divergence": div}  # fmt: skip
            if div is not None and div < min(len(out["fp32"]), len(out["native"])):
                prefix = ids + out["fp32"][:div]
                for k, m in (("fp32", fp32.model), ("native", nat.model)):
                    top, margin = margin_after(m, prefix)
                    row[f"{k}_margin"] = round(margin, 6)
                    row[f"{k}_top1"] = top
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    n = args.max_new_tokens
    diffs = [r for r in rows if not r["identical"]]
    summary = {
        "prompts": len(rows),
        "identical": len(rows) - len(diffs),
        "tokens_before_divergence": sum(
            n if r["identical"] else r["first_divergence"] for r in rows
        ),
        "tokens": n * len(rows),
        "fp32_margins_at_divergence": [r.get("fp32_margin") for r in diffs],
        "native_margins_at_divergence": [r.get("native_margin") for r in diffs],
    }
    record = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "model": args.model,
        "reference": "weights=fp32, attention exact, linear onednn, plain greedy (== HF fp32)",
        "native": "weights=native, the engine's default attention, plain greedy",
        "max_new_tokens": n,
        "wall_s": round(time.time() - t0, 1),
        "summary": summary,
        "prompts": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"{summary['identical']}/{summary['prompts']} prompts identical over {n} tokens; "
          f"{summary['tokens_before_divergence']}/{summary['tokens']} tokens before the first "
          f"divergence; fp32 top-1/top-2 margins there: {summary['fp32_margins_at_divergence']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
