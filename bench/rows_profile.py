"""Per kernel class time of one native int8 forward of M rows (torch profiler over the
:mod:`specpilot.profiling` ranges, 20 calls, 150 tokens of context), and the ops with the most
self time. A diagnostic.

    python bench/rows_profile.py 1 8 16
"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from specpilot.engine import Engine, EngineConfig
from specpilot.loading import load_model
from specpilot.profiling import set_kernel_ranges

torch.set_num_threads(2)
loaded = load_model("smollm2-135m", weights="native")
eng = Engine(loaded.model, EngineConfig(numerics="int8"))
model = loaded.model
c = 150
rows = [int(r) for r in sys.argv[1:]] or [1, 8, 16]
model.setup_cache(c + max(rows) + 1, attention=eng.cfg.resolved_attention)
set_kernel_ranges(True)
with torch.inference_mode():
    model(torch.full((1, c), 5), torch.arange(c)[None], 0, c)
    for m in rows:
        tok = torch.full((1, m), 5)
        pos = (torch.arange(m) + c)[None]
        for _ in range(3):
            model(tok, pos, c, c + m)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                model(tok, pos, c, c + m)
        ev = prof.key_averages()
        tot = {}
        for e in ev:
            tot[e.key] = e.cpu_time_total / 20 / 1e3
        print(f"--- rows={m}")
        for k in ["qkv", "attention", "o_proj", "gate_up", "down", "lm_head"]:
            print(f"  {k:10s} {tot.get(k, 0):6.2f} ms")
        top = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]
        for e in top:
            print(
                f"    self {e.key[:40]:40s} {e.self_cpu_time_total / 20 / 1e3:6.2f} ms"
                f"  calls {e.count // 20}"
            )
