"""Gemma 3 270M: greedy tokens of SpecPilot vs Hugging Face transformers on the same GGUF.

    python bench/gemma_parity.py --out bench/results/gemma_parity.json

Both sides run fp32 on the dequantized weights: SpecPilot loads the GGUF through its converter
(``--model``, default the packaged ``gemma3-270m``), transformers through its own GGUF loader
(``from_pretrained(dir, gguf_file=...)``, eager attention, ``generate`` greedy with a blank
generation config). For each prompt (the first ``--humaneval`` HumanEval and ``--chat`` chat
prompts, plus one long prompt of ``--long-tokens``+ tokens built from later HumanEval prompts, past
the 512-token window) SpecPilot decodes ``--new-tokens`` greedy tokens (plain decoding), and the
reference checks them:

* ``--hf forced`` (default): one transformers forward over prompt + our tokens; the greedy tokens
  are identical iff the reference's argmax after every prefix is our next token (greedy decoding
  is exactly this recursion), so the first position where it is not is the first divergence;
* ``--hf generate``: transformers ``generate`` greedy with its KV cache, compared token by token
  (the same verdict up to the reference's own cached-vs-full numerics; about 3x slower here).

It records the first divergence and the reference's top-1/top-2 logit margin there. The model has
no chat template, so chat prompts run as plain text (with BOS), as ``specpilot bench`` runs them.
The prompt ids are checked against transformers' tokenizer built from the same file; ``--spec``
also checks suffix-drafted speculative decoding against plain decoding. Not a speed benchmark.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from specpilot.drafters import make_drafter
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.loading import load_model
from specpilot.peers.hf import HFGreedy
from specpilot.tree import TreeSpec
from specpilot.workloads import load_workload


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def margin_at(hf: Any, ids: list[int], pos_tokens: list[int]) -> float:
    """The reference's top-1 minus top-2 logit after ``ids + pos_tokens``."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids + pos_tokens]), logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def forced_check(hf: Any, ids: list[int], ours: list[int]) -> tuple[int | None, float, float]:
    """(first index where the reference's greedy choice differs from ``ours`` or None, the
    top-1/top-2 margin there (or the smallest margin along ``ours``), the largest |logit|)."""
    with torch.no_grad():
        out = hf(torch.tensor([ids + ours[:-1]]), logits_to_keep=len(ours))
        logits = out.logits[0].float()  # row j: the choice after ids + ours[:j]
    top = torch.topk(logits, 2, dim=-1).values
    margins = top[:, 0] - top[:, 1]
    bad = (logits.argmax(-1) != torch.tensor(ours)).nonzero()
    div = int(bad[0]) if len(bad) else None
    margin = float(margins[div]) if div is not None else float(margins.min())
    return div, margin, float(logits.abs().max())


def long_prompt(tok: Any, n_tokens: int) -> str:
    """Later HumanEval prompts joined until the text encodes to at least ``n_tokens`` ids."""
    parts: list[str] = []
    for p in load_workload("humaneval")[40:]:
        parts.append(p.text)
        if len(tok.encode_prompt("\n".join(parts), chat=False)) >= n_tokens:
            break
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m", help="SpecPilot model spec")
    ap.add_argument("--gguf", default=None, help="GGUF for transformers (default: --model's)")
    ap.add_argument("--humaneval", type=int, default=20)
    ap.add_argument("--chat", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--hf", choices=("forced", "generate"), default="forced")
    ap.add_argument("--spec", action="store_true", help="also check speculative == plain")
    ap.add_argument("--out", default="bench/results/gemma_parity.json")
    args = ap.parse_args()
    import transformers

    torch.manual_seed(0)
    t0 = time.time()
    loaded = load_model(args.model, weights="fp32")
    gguf = Path(args.gguf or loaded.source)
    tok = loaded.tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    load_s = time.time() - t0
    engine = Engine(loaded.model, EngineConfig(attention="exact", linear="onednn"))
    gen = GenerationConfig(max_new_tokens=args.new_tokens, stop_on_eos=False)
    prompts = [(p.id, p.text, p.chat, "humaneval") for p in load_workload("humaneval")]
    prompts = prompts[: args.humaneval]
    prompts += [(p.id, p.text, p.chat, "chat") for p in load_workload("chat")][: args.chat]
    prompts.append(("long", long_prompt(tok, args.long_tokens), False, "long"))
    rows = []
    for pid, text, chat, group in prompts:
        ids = tok.encode_prompt(text, chat=chat)
        ours = engine.generate(ids, gen).tokens
        row: dict[str, Any] = {
            "id": pid,
            "group": group,
            "prompt_tokens": len(ids),
            "new_tokens": len(ours),
            "tokenizer_equal": ids == hf_tok(text)["input_ids"],
        }
        if args.hf == "forced":
            div, margin, _ = forced_check(hf, ids, ours)
            row["ref_min_margin" if div is None else "ref_margin_at_divergence"] = round(margin, 5)
        else:
            theirs = HFGreedy(hf).generate(ids, args.new_tokens, ())
            pairs = enumerate(zip(ours, theirs, strict=False))
            div = next((i for i, (a, b) in pairs if a != b), None)
            if div is not None:
                row["ref_margin_at_divergence"] = margin_at(hf, ids, theirs[:div])
        row["tokens_equal"] = div is None
        row["first_divergence"] = div
        if args.spec:
            spec = engine.generate(
                ids, gen, drafter=make_drafter("suffix"), spec=TreeSpec(kind="chain", k=4)
            )
            row["spec_equal_plain"] = spec.tokens == ours
            row["spec_tau"] = round(spec.tau, 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    summary = {}
    for group in ("humaneval", "chat", "long"):
        g = [r for r in rows if r["group"] == group]
        summary[group] = {
            "prompts": len(g),
            "tokens_equal": sum(r["tokens_equal"] for r in g),
            "tokenizer_equal": sum(r["tokenizer_equal"] for r in g),
            "spec_equal_plain": sum(r["spec_equal_plain"] for r in g) if args.spec else None,
            "max_prompt_tokens": max(r["prompt_tokens"] for r in g),
        }
    out = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": cpu_model(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": args.model,
        "gguf": str(gguf),
        "reference": "transformers GGUF loader, fp32 dequantized, eager attention, greedy "
        + (
            "checked by one forward over prompt + our tokens" if args.hf == "forced" else "generate"
        ),
        "ours": "specpilot load_model (GGUF -> fp32), attention exact, linear onednn, greedy",
        "new_tokens": args.new_tokens,
        "load_s": round(load_s, 1),
        "wall_s": round(time.time() - t0, 1),
        "summary": summary,
        "prompts": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=2))
    return 0 if all(r["tokens_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
