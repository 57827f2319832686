"""Batched benchmark (``specpilot bench --batch-size N``): batched AR vs batched speculative.

Protocol: all prompts are decoded with continuous batching at batch size N (a finished sequence's
row is refilled by the next prompt), first by batched AR (the reference), then by each
speculative candidate with a fresh drafter per request. Each candidate's outputs are compared
token by token with the reference (token forcing) before its speed is reported; batched AR
itself equals decoding each prompt alone (tests/test_batch.py). Per round (after a warm-up):
throughput = generated tokens / wall time of the whole run; per-request latency = time from the
start of the run to the request's last token (queueing included), p50 and p99 over requests.
The median round is reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specpilot.batch import (
    BatchConfig,
    BatchEngine,
    BatchOutput,
    BatchRequest,
    VerifyBudget,
    run_batch,
)
from specpilot.bench import Candidate, check_seeded, generation
from specpilot.engine import GenerationConfig
from specpilot.errors import ConfigError
from specpilot.forcing import ForcingReport, Reference, check
from specpilot.sampling import SamplingParams


@dataclass(frozen=True)
class BatchBenchConfig:
    batch_size: int = 8
    max_new_tokens: int = 128
    repeats: int = 1
    stop_on_eos: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Greedy, or seeded sampling (:class:`specpilot.bench.BenchConfig`)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.max_new_tokens <= 0 or self.repeats <= 0:
            raise ConfigError("--max-new-tokens and --repeats must be positive")
        check_seeded(self.sampling)


@dataclass
class ModeStats:
    """One mode (batched AR or a candidate) over the workload."""

    name: str
    tok_s: float | None
    """Median-round throughput; None when token forcing failed."""
    latency_p50_s: float
    latency_p99_s: float
    tau: float
    mean_draft_nodes: float
    lossless: bool = True
    mismatches: int = 0
    forcing: str = ""
    rounds_tok_s: list[float] = field(default_factory=list)


@dataclass
class BatchBenchResult:
    batch_size: int
    n_prompts: int
    max_new_tokens: int
    tokens_generated: int
    ar: ModeStats
    candidates: list[ModeStats]

    @property
    def lossless(self) -> bool:
        return all(c.lossless for c in self.candidates)

    def speedup(self, c: ModeStats) -> float | None:
        return c.tok_s / self.ar.tok_s if c.tok_s and self.ar.tok_s else None

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "n_prompts": self.n_prompts,
            "max_new_tokens": self.max_new_tokens,
            "tokens_generated": self.tokens_generated,
            "lossless": self.lossless,
            "ar": asdict(self.ar),
            "candidates": [{**asdict(c), "speedup": self.speedup(c)} for c in self.candidates],
        }


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else 0.0


def _run(
    engine: BatchEngine,
    prompts: Sequence[list[int]],
    gen: GenerationConfig,
    cand: Candidate | None,
) -> tuple[list[BatchOutput], float]:
    reqs = [
        BatchRequest(ids, gen, cand.make_drafter() if cand else None, cand.spec if cand else None)
        for ids in prompts
    ]
    t = time.perf_counter()
    outs = run_batch(engine, reqs)
    return outs, time.perf_counter() - t


def _stats(name: str, rounds: list[tuple[list[BatchOutput], float]]) -> ModeStats:
    outs = rounds[0][0]
    steps = sum(o.result.steps for o in outs)
    acc = sum(sum(o.result.accept_lengths) for o in outs)
    tok_s = [sum(len(o.result.tokens) for o in r) / w if w else 0.0 for r, w in rounds]
    mid = sorted(range(len(rounds)), key=lambda i: tok_s[i])[len(rounds) // 2]
    lat = [o.latency_s for o in rounds[mid][0]]
    return ModeStats(
        name=name,
        tok_s=statistics.median(tok_s),
        latency_p50_s=_pct(lat, 0.5),
        latency_p99_s=_pct(lat, 0.99),
        tau=(acc + steps) / steps if steps else 1.0,
        mean_draft_nodes=sum(sum(o.result.draft_nodes) for o in outs) / steps if steps else 0.0,
        rounds_tok_s=tok_s,
    )


def run_batch_bench(
    engine: BatchEngine,
    prompts: Sequence[tuple[str, list[int]]],
    candidates: Sequence[Candidate],
    cfg: BatchBenchConfig,
    progress: Callable[[str, int, int], None] | None = None,
) -> BatchBenchResult:
    """Benchmark batched AR and each candidate on ``prompts`` (id, token ids) at batch size N."""
    if not prompts:
        raise ConfigError("no prompts to benchmark")
    if engine.bcfg.max_batch != cfg.batch_size:
        raise ConfigError("the batch engine's max_batch must equal the benchmark's batch size")
    gen = generation(cfg.max_new_tokens, cfg.stop_on_eos, cfg.sampling)
    ids = [p for _, p in prompts]
    warm = GenerationConfig(max_new_tokens=min(8, cfg.max_new_tokens), stop_on_eos=False)
    _run(engine, ids[: cfg.batch_size], warm, None)
    for c in candidates:
        _run(engine, ids[: cfg.batch_size], warm, c)
    modes: list[Candidate | None] = [None, *candidates]
    rounds: list[list[tuple[list[BatchOutput], float]]] = [[] for _ in modes]
    total, done = cfg.repeats * len(modes), 0
    for r in range(cfg.repeats):
        # ABBA: every other repeat runs the modes in reverse, so a drift that is linear over a
        # pair of repeats weighs on every mode alike
        order = list(enumerate(modes))
        for i, c in order if r % 2 == 0 else order[::-1]:
            rounds[i].append(_run(engine, ids, gen, c))
            done += 1
            if progress is not None:
                progress(c.name if c else "AR", done, total)
    refs = [
        Reference(pid, tuple(o.result.tokens), None)
        for (pid, _), o in zip(prompts, rounds[0][0][0], strict=True)
    ]
    ar = _stats("AR (batched)", rounds[0])
    results = []
    for c, r in zip(candidates, rounds[1:], strict=True):
        outs = {pid: o.result.tokens for (pid, _), o in zip(prompts, r[0][0], strict=True)}
        rep: ForcingReport = check(refs, outs, strict=True)
        st = _stats(c.name, r)
        st.lossless, st.mismatches, st.forcing = rep.ok, len(rep.divergences), rep.summary()
        if not rep.ok:
            st.tok_s = None
        results.append(st)
    return BatchBenchResult(
        batch_size=cfg.batch_size,
        n_prompts=len(prompts),
        max_new_tokens=cfg.max_new_tokens,
        tokens_generated=sum(len(x.tokens) for x in refs),
        ar=ar,
        candidates=results,
    )


def batch_config_for(
    batch_size: int,
    prompts: Sequence[list[int]],
    max_new: int,
    max_nodes: int,
    budget: VerifyBudget | None = None,
    min_gain: float = 0.0,
) -> BatchConfig:
    """A cache just large enough for the longest prompt + max_new + a draft tree (+ scratch)."""
    longest = max((len(p) for p in prompts), default=1)
    return BatchConfig(
        max_batch=batch_size,
        max_len=longest + max_new + max_nodes + 3,
        budget=budget or VerifyBudget(),
        min_gain=min_gain,
    )


def plan_budget(plan_path: str | None, max_nodes: int) -> VerifyBudget | None:
    """The verify budget of a plan's ``batch_budget`` option (None without a plan or option)."""
    if not plan_path:
        return None
    from specpilot.plan import load_plan
    from specpilot.runtime import plan_options

    opt = plan_options(load_plan(plan_path)).get("batch_budget")
    return None if opt is None else VerifyBudget.from_table(opt.table, max(max_nodes, 1))
