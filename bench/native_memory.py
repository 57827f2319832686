"""Resident memory of a loaded model against its GGUF file: native weights vs fp32.

For each model and weights mode, a fresh process (so nothing earlier stays resident) imports
torch and specpilot, loads the kernels and touches the meta device once (one-time code, not the
model), reads its RSS, loads the model, and reports:

* ``rss_load``: RSS after the load minus RSS before (after ``gc.collect``); ``rss_trim``: the same
  after glibc's ``malloc_trim(0)`` hands freed heap back (what the load left allocated, not what
  the allocator kept);
* ``rss_run``: the same after one forward (minus the KV cache): the fp32 path maps its
  converted safetensors file, so its weights become resident only when read;
* ``tensors``: bytes of the model's parameters and buffers (each storage once);
* ``kv``: the KV cache for ``--max-len`` slots with the engine's default attention (not in the
  two figures above; the target is ``rss_load <= 1.2 x file`` plus this);
* ``fp32_copies``: what building the default drafter adds, counted separately: the fp32
  embedding / LM-head copies that native modules make on demand
  (:func:`specpilot.loading.native.fp32_copy_bytes`) and the RSS the drafter build added.

A first load of each model (a warm-up process) writes the converted-model / header caches, so
the measured loads read them as a user's second run does.

    python bench/native_memory.py [--models smollm2-135m gemma3-270m] [--modes native fp32]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MB = 1e6


def _rss() -> int:
    import psutil

    gc.collect()
    return int(psutil.Process().memory_info().rss)


def _trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _unique_bytes(tensors: list[Any]) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def measure(model: str, weights: str, max_len: int) -> dict[str, Any]:
    """One model in this process (call it in a fresh one)."""
    import torch

    from specpilot import kernels
    from specpilot.config import ModelConfig
    from specpilot.engine import EngineConfig
    from specpilot.loading import load_model, native, resolve_spec
    from specpilot.model import Transformer

    kernels.available()  # the extension is loaded before the first reading
    with torch.device("meta"):  # and torch's meta-device code (~50 MB of modules, once)
        Transformer(ModelConfig(arch="llama", vocab_size=32, dim=8, n_layers=1, n_heads=1,
                                n_kv_heads=1, intermediate_size=8))  # fmt: skip
    path = resolve_spec(model)
    before = _rss()
    loaded = load_model(model, weights=weights)
    rss_load = _rss() - before
    _trim()
    rss_trim = _rss() - before
    m = loaded.model
    tensors = _unique_bytes([*m.parameters(), *m.buffers()])
    m.setup_cache(max_len, attention=EngineConfig().resolved_attention)
    kv = _unique_bytes([t for layer in m.model.layers for t in (layer.self_attn.cache.k,
                                                                layer.self_attn.cache.v)])
    ids = torch.tensor([loaded.tokenizer.encode("def fib(n): return n")])
    with torch.no_grad():  # one forward: lazily mapped weights (fp32 safetensors) become resident
        m(ids, torch.arange(ids.shape[1])[None], 0, ids.shape[1])
    rss_run = _rss() - before - kv
    from specpilot.drafters import make_drafter
    from specpilot.runtime import default_drafting

    name, _ = default_drafting(loaded)
    pre = _rss()
    with torch.no_grad():
        make_drafter(name, target=loaded, tokenizer=loaded.tokenizer)
    drafter_rss = _rss() - pre
    return {
        "model": model,
        "weights": "native" if m.native else "fp32",
        "file": path.stat().st_size,
        "rss_load": rss_load,
        "rss_trim": rss_trim,
        "rss_run": rss_run,
        "tensors": tensors,
        "kv": kv,
        "max_len": max_len,
        "drafter": name,
        "fp32_copies": native.fp32_copy_bytes(m) if m.native else 0,
        "drafter_rss": drafter_rss,
        "notes": list(loaded.notes),
    }


def _child(model: str, weights: str, max_len: int, warm: bool) -> dict[str, Any] | None:
    argv = [sys.executable, __file__, "--child", model, weights, str(max_len)]
    if warm:
        argv.append("--warm")
    out = subprocess.run(argv, capture_output=True, text=True, check=False,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    if out.returncode != 0:
        print(f"{model} {weights}: failed\n{out.stderr.strip()[-2000:]}", file=sys.stderr)
        return None
    return None if warm else json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    p.add_argument("--modes", nargs="+", default=["native", "fp32"], choices=["native", "fp32"])
    p.add_argument("--max-len", type=int, default=2048, help="KV cache slots (default 2048)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--child", nargs=3, metavar=("M", "W", "L"), help=argparse.SUPPRESS)
    p.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        model, weights, max_len = args.child
        if args.warm:
            from specpilot.loading import load_model

            load_model(model, weights=weights)
            return 0
        print(json.dumps(measure(model, weights, int(max_len))))
        return 0
    rows = []
    print(f"{'model':14} {'weights':7} {'file':>7} {'rss_load':>9} {'x file':>6} {'rss_trim':>9} "
          f"{'rss_run':>8} {'x file':>6} {'tensors':>8} {'x file':>6} {'kv':>7} "
          f"{'fp32 copies':>11} {'drafter rss':>11}  drafter")
    for model in args.models:
        for weights in args.modes:
            _child(model, weights, args.max_len, warm=True)
            r = _child(model, weights, args.max_len, warm=False)
            if r is None:
                continue
            rows.append(r)
            f = r["file"]
            print(f"{model:14} {r['weights']:7} {f / MB:7.1f} {r['rss_load'] / MB:9.1f} "
                  f"{r['rss_load'] / f:6.2f} {r['rss_trim'] / MB:9.1f} {r['rss_run'] / MB:8.1f} "
                  f"{r['rss_run'] / f:6.2f} {r['tensors'] / MB:8.1f} "
                  f"{r['tensors'] / f:6.2f} {r['kv'] / MB:7.1f} {r['fp32_copies'] / MB:11.1f} "
                  f"{r['drafter_rss'] / MB:11.1f}  {r['drafter']}")
    print(f"MB = 1e6 bytes; kv = {args.max_len} slots, the engine's default attention; fp32 copies "
          "and drafter rss: building the default drafter (not in rss_load)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
