"""Fixed-width steps on a GPU: are plain decoding and chain verification bit-identical, and what
does each verify path cost? A model of SmolLM2-135M's shapes with seeded random weights (no file
to carry: numerics and step cost depend on the shapes, not on the weights' values).

    python bench/gpu_fixed_width.py [--out DIR] [--prompts 6] [--tokens 128] [--dtype bfloat16]

Per verify path (eager; CUDA graphs; fixed width with CUDA graphs; fixed width eager) and per
prompt: plain decoding, then speculative decoding with a chain of 4 drafted by a drafter that
knows plain decoding's continuation and proposes each token with probability 0.8 (so acceptance
is set, not measured: this measures the verify path, not a drafter), token-forced against plain
decoding, and the KV caches of both compared bit for bit over every committed slot.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from specpilot.config import ModelConfig
from specpilot.drafters.base import DraftContext
from specpilot.engine import Engine, EngineConfig, GenerationConfig
from specpilot.model import Transformer, init_weights
from specpilot.tree import DraftTree, TreeSpec

SMOLLM2_SHAPES = dict(arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9,
                      n_kv_heads=3, intermediate_size=1536, tie_embeddings=True)  # fmt: skip
MODES = {
    "eager": {},
    "graphs": {"cuda_graphs": True},
    "fixed8+graphs": {"cuda_graphs": True, "fixed_width": 8},
    "fixed8 eager": {"fixed_width": 8},
}


class KnowingDrafter:
    """Proposes a chain from a known continuation, each token right with probability ``hit``
    (a wrong token ends what can be accepted)."""

    name = "knowing"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, continuation: list[int], vocab: int, hit: float, seed: int) -> None:
        self.ref, self.vocab, self.hit = continuation, vocab, hit
        self.rng = random.Random(seed)

    def begin(self, prompt: list[int]) -> None:
        self.p = len(prompt)

    def finish(self, tokens: list[int]) -> None:
        pass

    def propose(self, ctx: DraftContext) -> DraftTree:
        done = len(ctx.tokens) - self.p
        toks = []
        for d in range(ctx.spec.k):
            i = done + d
            right = i < len(self.ref) and self.rng.random() < self.hit
            toks.append(self.ref[i] if right else self.rng.randrange(self.vocab))
        return DraftTree.from_parents(toks, list(range(-1, len(toks) - 1)))


def _cache(m: Transformer, n: int) -> list[torch.Tensor]:
    return [t[..., :n, :].clone() for layer in m.model.layers
            for t in (layer.self_attn.cache.k, layer.self_attn.cache.v)]  # fmt: skip


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Any) -> tuple[Any, float]:
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t


def run_mode(model: Transformer, mode: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    eng = Engine(model, EngineConfig(device=args.device, dtype=args.dtype, **mode))
    gen = GenerationConfig(max_new_tokens=args.tokens, stop_on_eos=False)
    spec = TreeSpec(kind="chain", k=4)
    g = random.Random(0)
    prompts = [[g.randrange(1, 49152) for _ in range(g.randrange(40, 300))]
               for _ in range(args.prompts + 1)]  # fmt: skip
    ar_t = sp_t = 0.0
    n_tok = same_tokens = same_cache = steps = accepted = 0
    for i, p in enumerate(prompts):
        ref, ta = _timed(lambda p=p: eng.generate(p, gen))
        n = len(p) + len(ref.tokens) - 1
        a = _cache(model, n)
        drafter = KnowingDrafter(ref.tokens, 49152, 0.8, i)
        res, ts = _timed(lambda p=p, d=drafter: eng.generate(p, gen, drafter=d, spec=spec))
        if i == 0:  # warm-up (graph captures)
            continue
        ar_t, sp_t, n_tok = ar_t + ta, sp_t + ts, n_tok + len(ref.tokens)
        same_tokens += res.tokens == ref.tokens
        same_cache += all(torch.equal(x, y) for x, y in zip(a, _cache(model, n), strict=True))
        steps, accepted = steps + res.steps, accepted + sum(res.accept_lengths)
    out = {
        "ar_tok_s": round(n_tok / ar_t, 1),
        "spec_tok_s": round(n_tok / sp_t, 1),
        "spec_vs_ar": round(ar_t / sp_t, 3),
        "tau": round((accepted + steps) / steps, 3),
        "identical_tokens": same_tokens,
        "identical_caches": same_cache,
        "prompts": args.prompts,
    }
    if eng._fast is not None:
        out["graph_replays"] = eng._fast.replays
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=SMOLLM2_SHAPES["n_layers"])
    args = ap.parse_args()
    shapes = {**SMOLLM2_SHAPES, "n_layers": args.layers}
    cfg = ModelConfig(max_position=2048, **shapes)  # type: ignore[arg-type]
    model = Transformer(cfg)
    model.tie_weights()
    init_weights(model, seed=0, std=0.05)
    model.eval().requires_grad_(False)
    model.to(device=args.device, dtype=getattr(torch, args.dtype))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    result: dict[str, Any] = {"gpu": gpu, "dtype": args.dtype, "layers": args.layers}
    for name in args.modes.split(","):
        try:
            result[name] = run_mode(model, MODES[name], args)
        except Exception as e:
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, json.dumps(result[name]), flush=True)
        Path(args.out, "gpu_fixed_width.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
