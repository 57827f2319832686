"""Check and time the GPU paths on a CUDA machine (bf16 / fp32; eager, CUDA graphs, fixed width).

    python bench/gpu_check.py --model PATH.gguf --out DIR [--limit 20] [--max-new-tokens 128]

Writes ``DIR/gpu_check.json`` and prints one line per figure. Sections, each recorded even when
another fails:

* ``invariance``: whether the GPU's stock kernels are batch-invariant at the model's shapes: for
  each projection (F.linear) and for attention (SDPA with a causal tree-style mask), is every
  row of a call with m rows bit-identical to the same row computed alone? Speculative decoding
  is lossless by construction only where they are (the CPU kernels' contract,
  :mod:`specpilot.kernels`); elsewhere forcing catches what differs.
* ``decode``: per dtype and verify path (:data:`MODES`), plain decoding and speculative
  decoding (each drafter) interleaved per prompt, timed with the device synchronized; every
  speculative output is token-forced against plain decoding of the same engine. A run that is
  not identical keeps its speed figure here for diagnosis only, next to how many prompts
  diverged and at which reference margin (``specpilot bench`` gives a lossy run no speed).
* ``hf``: Hugging Face transformers' greedy ``generate`` on the same weights, dtype and prompts
  (the peer), with its token agreement.

Not a test: the CPU suite never runs it; ``bench/gpu_check.sh`` runs it on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specpilot.engine import EngineConfig, GenerationConfig
from specpilot.forcing import Reference, check
from specpilot.loading import load_model
from specpilot.plan import Plan
from specpilot.runtime import DEFAULT_TREE, HEAD_TREE, build
from specpilot.tree import TreeSpec
from specpilot.workloads import load_workload

ROWS = (1, 2, 3, 4, 5, 8, 11, 16, 17, 32, 33, 64)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def env() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(
            gpu=p.name,
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
            memory_gb=round(p.total_memory / 2**30, 1),
        )
    return out


def _rows_differ(full: torch.Tensor, alone: list[torch.Tensor]) -> bool:
    return any(not torch.equal(full[i], a) for i, a in enumerate(alone))


def linear_invariance(
    shapes: dict[str, tuple[int, int]], dtype: torch.dtype, device: str
) -> dict[str, list[int]]:
    """Per projection (out, in): the row counts whose rows differ from the same rows alone."""
    g = torch.Generator(device="cpu").manual_seed(0)
    out: dict[str, list[int]] = {}
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
        x = torch.randn(max(ROWS), k, generator=g).to(device, dtype)
        alone = [F.linear(x[i : i + 1], w)[0] for i in range(max(ROWS))]
        out[name] = [m for m in ROWS if _rows_differ(F.linear(x[:m], w), alone[:m])]
    return out


def attention_invariance(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, prefix: int = 300
) -> list[int]:
    """Query counts m whose rows of SDPA (prefix keys + causal block of m) differ from the same
    query alone over the keys it may see (the verify step's mask shape)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    n = max(ROWS)
    q = torch.randn(1, heads, n, head_dim, generator=g).to(device, dtype)
    k = torch.randn(1, heads, prefix + n, head_dim, generator=g).to(device, dtype)
    v = torch.randn(1, heads, prefix + n, head_dim, generator=g).to(device, dtype)
    del kv_heads  # keys/values repeated per head, as the engine's SDPA call sees them

    def run(rows: slice, keys: int) -> torch.Tensor:
        m = rows.stop - rows.start
        mask = torch.ones(m, keys, dtype=torch.bool, device=device)
        mask[:, prefix:] = torch.ones(m, keys - prefix, device=device).tril(rows.start).bool()
        return F.scaled_dot_product_attention(
            q[:, :, rows], k[:, :, :keys], v[:, :, :keys], attn_mask=mask
        )[0].transpose(0, 1)

    alone = [run(slice(i, i + 1), prefix + n)[0] for i in range(n)]
    return [m for m in ROWS if _rows_differ(run(slice(0, m), prefix + n), alone[:m])]


def keylen_invariance(heads: int, head_dim: int, dtype: torch.dtype, device: str) -> list[int]:
    """Extra (masked) key slots e whose call changes a query row's bits against the same row
    over exactly the keys it sees: plain decoding attends over its prefix, a verify row over the
    prefix plus the tree block, the rest masked."""
    g = torch.Generator(device="cpu").manual_seed(2)
    keys = 301
    q = torch.randn(1, heads, 1, head_dim, generator=g).to(device, dtype)
    k = torch.randn(1, heads, keys + 64, head_dim, generator=g).to(device, dtype)
    v = torch.randn(1, heads, keys + 64, head_dim, generator=g).to(device, dtype)
    base = F.scaled_dot_product_attention(q, k[:, :, :keys], v[:, :, :keys])
    out = []
    for extra in (1, 3, 7, 15, 63):
        mask = torch.zeros(1, keys + extra, dtype=torch.bool, device=device)
        mask[:, :keys] = True
        got = F.scaled_dot_product_attention(q, k[:, :, : keys + extra], v[:, :, : keys + extra],
                                             attn_mask=mask)  # fmt: skip
        if not torch.equal(got, base):
            out.append(extra)
    return out


def norm_invariance(dim: int, dtype: torch.dtype, device: str) -> list[int]:
    """Row counts whose RMSNorm rows (torch's fused op) differ from the same row alone."""
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(max(ROWS), dim, generator=g).to(device, dtype)
    w = torch.randn(dim, generator=g).to(device, dtype)
    alone = [F.rms_norm(x[i : i + 1], (dim,), w, 1e-5)[0] for i in range(max(ROWS))]
    return [m for m in ROWS if _rows_differ(F.rms_norm(x[:m], (dim,), w, 1e-5), alone[:m])]


def invariance(cfg: Any, device: str) -> dict[str, Any]:
    d, hd = cfg.dim, cfg.head_dim
    shapes = {
        "q_proj": (cfg.n_heads * hd, d),
        "k_proj": (cfg.n_kv_heads * hd, d),
        "o_proj": (d, cfg.n_heads * hd),
        "gate_proj": (cfg.intermediate_size, d),
        "down_proj": (d, cfg.intermediate_size),
        "lm_head": (cfg.vocab_size, d),
    }
    out: dict[str, Any] = {"rows_tried": list(ROWS)}
    for name, dt in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        out[name] = {
            "linear_rows_that_differ": linear_invariance(shapes, dt, device),
            "sdpa_rows_that_differ": attention_invariance(
                cfg.n_heads, cfg.n_kv_heads, hd, dt, device
            ),
            "sdpa_extra_masked_keys_that_differ": keylen_invariance(cfg.n_heads, hd, dt, device),
            "rms_norm_rows_that_differ": norm_invariance(d, dt, device),
        }
    tf32 = torch.backends.cuda.matmul.allow_tf32
    out["allow_tf32"] = tf32
    return out


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    sync()
    t = time.perf_counter()
    res = fn()
    sync()
    return res, time.perf_counter() - t


MODES = {
    "eager": {},
    "graphs": {"cuda_graphs": True},
    "fixed": {"cuda_graphs": True, "fixed_width": 6},
}
"""Verify paths: the default step, CUDA graphs at padded buckets, fixed-width steps in graphs."""


def decode(
    args: argparse.Namespace,
    dtype: str,
    mode: str,
    attention: str,
    drafters: list[tuple[str, TreeSpec]],
) -> dict[str, Any]:
    """Plain vs speculative decoding on both workloads for one engine configuration."""
    torch_dtype = getattr(torch, dtype)
    loaded = load_model(args.model, device=args.device, dtype=torch_dtype, weights="fp32")
    eng_cfg = EngineConfig(device=args.device, dtype=dtype, attention=attention, **MODES[mode])
    plans = [(f"{name}/{tree.kind}", Plan(drafter=name, tree=tree, engine=eng_cfg))
             for name, tree in drafters]  # fmt: skip
    # the peer's weights before building (CPU builds prepack the model's own)
    hf_sd = (
        {k: v.detach().float().cpu() for k, v in loaded.model.state_dict().items()}
        if args.hf
        else None
    )
    built = [build(p, loaded) for _, p in plans]
    engine = built[0].engine
    tok = loaded.tokenizer
    out: dict[str, Any] = {
        "dtype": dtype,
        "mode": mode,
        "attention": engine.attention,
        "workloads": {},
    }
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    ref_gen = GenerationConfig(max_new_tokens=args.max_new_tokens, record_margins=True)
    for wl, limit in (("humaneval", args.limit), ("chat", args.chat_limit)):
        if limit <= 0:
            continue
        prompts = [
            (p.id, tok.encode_prompt(p.text, chat=p.chat)) for p in load_workload(wl, limit=limit)
        ]
        warm = GenerationConfig(max_new_tokens=16, stop_on_eos=False)
        for _, ids in prompts[:2]:  # warm-up: kernels, graphs at the first widths
            engine.generate(ids, warm, eos_ids=tok.eos_ids)
            for b in built:
                engine.generate(
                    ids, warm, drafter=b.make_drafter(), spec=b.spec, eos_ids=tok.eos_ids
                )
        refs, ar_t, ar_n, ar_each = [], 0.0, 0, []
        cand = {
            label: {"t": 0.0, "n": 0, "outs": {}, "steps": 0, "acc": 0, "error": None}
            for label, _ in plans
        }
        drafter_of = {label: b.make_drafter() for (label, _), b in zip(plans, built, strict=True)}
        for pid, ids in prompts:
            ref = engine.generate(ids, ref_gen, eos_ids=tok.eos_ids)
            refs.append(Reference(pid, tuple(ref.tokens), tuple(ref.margins)))
            res, dt = _timed(lambda ids=ids: engine.generate(ids, gen, eos_ids=tok.eos_ids))
            ar_t, ar_n = ar_t + dt, ar_n + len(res.tokens)
            ar_each.append((len(res.tokens), dt))
            for (label, _), b in zip(plans, built, strict=True):
                c = cand[label]
                if c["error"]:
                    continue
                try:
                    r, dt = _timed(
                        lambda ids=ids, b=b, d=drafter_of[label]: engine.generate(
                            ids, gen, drafter=d, spec=b.spec, eos_ids=tok.eos_ids
                        )
                    )
                except Exception as e:  # recorded, the other candidates go on
                    c["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                    continue
                c["t"] += dt
                c["n"] += len(r.tokens)
                c["outs"][pid] = r.tokens
                c["steps"] += r.steps
                c["acc"] += sum(r.accept_lengths)
        ar_tok_s = ar_n / ar_t
        w: dict[str, Any] = {
            "prompts": len(prompts),
            "ar_tok_s": round(ar_tok_s, 1),
            "ar_ms_per_token": round(1e3 * ar_t / ar_n, 3),
            "candidates": {},
        }
        print(f"[{dtype} {mode} {wl}] AR {ar_tok_s:.1f} tok/s", flush=True)
        for label, c in cand.items():
            if c["error"] or not c["t"]:
                w["candidates"][label] = {"error": c["error"]}
                print(f"  {label}: ERROR {c['error']}", flush=True)
                continue
            rep = check(refs, c["outs"], strict=True)
            tok_s = c["n"] / c["t"]
            margins = [d.ref_margin for d in rep.divergences]
            w["candidates"][label] = {
                "tok_s": round(tok_s, 1),
                "vs_ar": round(tok_s / ar_tok_s, 3),
                "tau": round((c["acc"] + c["steps"]) / c["steps"], 3),
                "identical": len(prompts) - len(rep.divergences),
                "forcing": rep.summary(),
                "divergence_margins": margins,
            }
            print(
                f"  {label}: {tok_s:.1f} tok/s ({tok_s / ar_tok_s:.2f}x AR), tau "
                f"{w['candidates'][label]['tau']}, identical "
                f"{len(prompts) - len(rep.divergences)}/{len(prompts)}",
                flush=True,
            )
        out["workloads"][wl] = w
        if wl == "humaneval":
            out["hf"] = hf_peer(loaded, hf_sd, torch_dtype, prompts, refs, args) if hf_sd else None
            if out["hf"] and "tok_s" in out["hf"]:  # ours on the peer's prompts, same run
                part = ar_each[: out["hf"]["prompts"]]
                out["hf"]["ours_ar_tok_s"] = round(
                    sum(n for n, _ in part) / sum(t for _, t in part), 1
                )
    if engine._fast is not None:
        out["graph_replays"] = engine._fast.replays
    return out


def hf_peer(
    loaded: Any,
    sd: dict[str, torch.Tensor],
    dtype: torch.dtype,
    prompts: list[tuple[str, list[int]]],
    refs: list[Reference],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Hugging Face greedy generate on the same weights, dtype and prompts."""
    from specpilot.peers.hf import HFGreedy, build_hf_model

    try:
        hf = build_hf_model(loaded.cfg, sd).to(args.device, dtype)
        peer = HFGreedy(hf)
        peer.generate(prompts[0][1], 16, ())
        n, t, same = 0, 0.0, 0
        prompts, refs = prompts[: args.hf_limit], refs[: args.hf_limit]  # eager: slow per token
        for (_, ids), ref in zip(prompts, refs, strict=True):
            toks, dt = _timed(
                lambda ids=ids: peer.generate(
                    ids, args.max_new_tokens, tuple(loaded.tokenizer.eos_ids)
                )
            )
            n, t, same = n + len(toks), t + dt, same + int(tuple(toks) == ref.tokens)
        print(
            f"  hf-greedy: {n / t:.1f} tok/s, identical to ours {same}/{len(prompts)}", flush=True
        )
        return {"tok_s": round(n / t, 1), "identical": same, "prompts": len(prompts)}
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--chat-limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--configs",
        default="bfloat16:fixed,bfloat16:graphs,float32:fixed",
        help="dtype:mode pairs; modes: " + ", ".join(MODES),
    )
    ap.add_argument(
        "--no-hf",
        dest="hf",
        action="store_false",
        help="skip the Hugging Face peer (it runs on the first configuration only)",
    )
    ap.add_argument("--hf-limit", type=int, default=8, help="prompts the peer decodes")
    ap.add_argument(
        "--drafters",
        default="suffix/chain,head+suffix/chain",
        help="NAME/SHAPE candidates; SHAPE chain = a chain of 5, dynamic = the CPU default tree "
        "of 10 (not under fixed widths)",
    )
    ap.add_argument("--skip-invariance", action="store_true")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"env": env(), "args": vars(args)}
    path = out_dir / "gpu_check.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=2) + "\n")

    print(json.dumps(result["env"]), flush=True)
    if not args.skip_invariance:
        try:
            cfg = load_model(args.model, weights="fp32").cfg
            result["invariance"] = invariance(cfg, args.device)
            print("invariance:", json.dumps(result["invariance"]), flush=True)
        except Exception as e:
            traceback.print_exc()
            result["invariance"] = {"error": f"{type(e).__name__}: {e}"}
        save()
    trees = {"chain": DEFAULT_TREE, "dynamic": HEAD_TREE}
    drafters = [(d.split("/")[0], trees[d.split("/")[1]]) for d in args.drafters.split(",")]
    result["decode"] = []
    for item in args.configs.split(","):
        dtype, mode = item.split(":")
        attention = "exact" if dtype == "float32" else "sdpa"
        t = time.perf_counter()
        try:
            r = decode(args, dtype, mode, attention, drafters)
            args.hf = False  # the peer on the first configuration only
        except Exception as e:
            traceback.print_exc()
            r = {"dtype": dtype, "mode": mode, "error": f"{type(e).__name__}: {e}"}
        r["wall_s"] = round(time.perf_counter() - t, 1)
        result["decode"].append(r)
        save()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
