"""cProfile of the default plan (int8) on 10 prompts of a workload x 128 tokens, after a plain pass
and a prefill-only pass for scale. A diagnostic (the profiler slows every call).

    python bench/spec_profile.py humaneval|chat
"""

import cProfile
import pstats
import sys
import time

from specpilot import cli
from specpilot.engine import GenerationConfig
from specpilot.workloads import load_workload

args = cli.build_parser().parse_args(
    ["bench", "--threads", "2", "--numerics", "int8", "--workload", sys.argv[1]]
)
loaded, engine, cands, _ = cli._setup(args, hf_peers=False)
tok, c = loaded.tokenizer, cands[0]
prompts = load_workload(sys.argv[1], limit=10)
enc = [tok.encode_prompt(p.text, chat=p.chat) for p in prompts]
gen = GenerationConfig(max_new_tokens=128)
# warm
engine.generate(enc[0], gen, drafter=c.make_drafter(), spec=c.spec, eos_ids=tok.eos_ids)
engine.generate(enc[0], gen, eos_ids=tok.eos_ids)
t = time.perf_counter()
n = 0
st = 0
for ids in enc:
    r = engine.generate(ids, gen, eos_ids=tok.eos_ids)
    n += len(r.tokens)
tar = time.perf_counter() - t
print(f"AR {n} tok {tar:.2f}s {n / tar:.1f} tok/s")
# prefill only
t = time.perf_counter()
for ids in enc:
    engine.generate(ids, GenerationConfig(max_new_tokens=1), eos_ids=tok.eos_ids)
print(
    f"prefill+1 x{len(enc)}: {time.perf_counter() - t:.2f}s"
    f"  prompt tokens {sum(len(e) for e in enc)}"
)
pr = cProfile.Profile()
t = time.perf_counter()
n = 0
pr.enable()
for ids in enc:
    r = engine.generate(ids, gen, drafter=c.make_drafter(), spec=c.spec, eos_ids=tok.eos_ids)
    n += len(r.tokens)
    st += r.steps
pr.disable()
ts = time.perf_counter() - t
print(f"spec {n} tok {st} steps {ts:.2f}s {n / ts:.1f} tok/s  {1e3 * ts / st:.2f} ms/step")
pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
