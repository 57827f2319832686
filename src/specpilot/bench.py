"""Side-by-side benchmark: plain AR vs speculative decoding (and optional peers), token-forced.

Protocol (the same for every figure in BENCHMARKS.md):
  1. warm-up: a short AR, speculative and peer generation on the first prompt (not timed);
  2. round 1: per prompt, interleaved, AR (the reference, with logit margins), each speculative
     candidate, then each peer; the candidates' and peers' outputs are compared token by token
     with the reference (token forcing) before any speed is reported;
  3. rounds 2..R: the same, timed only; each round gets a fresh drafter, so nothing a drafter
     learned from an earlier round's outputs carries over.
Speed = generated tokens / wall time of the generate calls (prefill included), per round;
the reported figure is the median over rounds. A speculative run that fails forcing gets no
speed figure (``spec_tok_s`` and ``speedup`` are None). Several candidates (tree shapes,
drafters) can share one reference run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from specpilot.drafters.base import Drafter
from specpilot.engine import Engine, GenerationConfig, GenerationResult
from specpilot.errors import ConfigError
from specpilot.forcing import ForcingReport, Reference, check
from specpilot.sampling import SamplingParams
from specpilot.tree import TreeSpec


class Peer(Protocol):
    name: str

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...]
    ) -> list[int]: ...


@dataclass(frozen=True)
class BenchConfig:
    max_new_tokens: int = 128
    repeats: int = 1
    """Timed rounds (the first also verifies); the median round is reported."""
    stop_on_eos: bool = True
    strict: bool = True
    """Any divergence from the reference fails forcing (non-strict tolerates near-ties)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Greedy by default; seeded sampling otherwise (a seeded request's text is the same with
    or without speculation, so token forcing still applies: :mod:`specpilot.sampling`)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ConfigError(f"--max-new-tokens must be positive, got {self.max_new_tokens}")
        if self.repeats <= 0:
            raise ConfigError(f"--repeats must be positive, got {self.repeats}")
        check_seeded(self.sampling)


def check_seeded(sampling: SamplingParams) -> None:
    """ConfigError for sampled benchmarking without a seed (nothing to token-force against)."""
    if not sampling.greedy and sampling.seed is None:
        raise ConfigError(
            "sampled benchmarks need --seed: token forcing compares seeded runs, which give the "
            "same text with and without speculation"
        )


def generation(
    max_new_tokens: int, stop_on_eos: bool, sampling: SamplingParams, margins: bool = False
) -> GenerationConfig:
    """The GenerationConfig of a benchmark run."""
    s = sampling
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        stop_on_eos=stop_on_eos,
        record_margins=margins,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        seed=s.seed,
    )


@dataclass
class PeerStats:
    tok_s: float
    identical: bool
    """Every prompt's tokens equal our AR reference."""
    n_identical: int
    n_prompts: int


@dataclass(frozen=True)
class Candidate:
    """A speculative configuration to benchmark: a drafter (built fresh per round) and a shape."""

    name: str
    drafter: str
    make_drafter: Callable[[], Drafter | None]
    spec: TreeSpec


@dataclass
class CandidateResult:
    name: str
    drafter: str
    tree: dict[str, Any]
    spec_tok_s: float | None
    """None when token forcing failed: a lossy run gets no speed figure."""
    speedup: float | None
    tau: float
    acceptance_by_depth: list[float]
    mean_draft_nodes: float
    draft_ms_per_step: float
    lossless: bool
    mismatches: int
    forcing: ForcingReport
    rounds_tok_s: list[float] = field(default_factory=list)
    rounds_speedup: list[float] = field(default_factory=list)
    """Each round's speed over own AR's in the same round (the two interleaved per prompt): on
    a host whose speed drifts between minutes, the median of these pairs like with like, where
    ``speedup`` (median over median) may pair a slow round of one with a fast one of the
    other."""

    @property
    def paired_speedup(self) -> float | None:
        """The median of :attr:`rounds_speedup` (None without a speed figure)."""
        return statistics.median(self.rounds_speedup) if self.rounds_speedup else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["paired_speedup"] = self.paired_speedup
        d["forcing"] = {
            "status": self.forcing.status,
            "summary": self.forcing.summary(),
            "divergences": [asdict(x) for x in self.forcing.divergences],
        }
        return d


@dataclass
class BenchResult:
    n_prompts: int
    max_new_tokens: int
    ar_tok_s: float
    candidates: list[CandidateResult]
    peers: dict[str, PeerStats] = field(default_factory=dict)
    rounds_ar_tok_s: list[float] = field(default_factory=list)
    tokens_generated: int = 0

    @property
    def primary(self) -> CandidateResult | None:
        return self.candidates[0] if self.candidates else None

    @property
    def lossless(self) -> bool:
        return all(c.lossless for c in self.candidates)

    def to_json(self) -> dict[str, Any]:
        """Flat figures of the first candidate, plus every candidate and peer."""
        p = self.primary
        return {
            "n_prompts": self.n_prompts,
            "max_new_tokens": self.max_new_tokens,
            "tokens_generated": self.tokens_generated,
            "ar_tok_s": self.ar_tok_s,
            "rounds_ar_tok_s": self.rounds_ar_tok_s,
            "drafter": p.drafter if p else "none",
            "tree": p.tree if p else None,
            "spec_tok_s": p.spec_tok_s if p else None,
            "speedup": p.speedup if p else None,
            "tau": p.tau if p else 1.0,
            "lossless": self.lossless,
            "mismatches": sum(c.mismatches for c in self.candidates),
            "candidates": [c.to_json() for c in self.candidates],
            "peers": {k: asdict(v) for k, v in self.peers.items()},
        }


ProgressFn = Callable[[str, int, int], None]


@dataclass
class _Tally:
    tokens: int = 0
    seconds: float = 0.0

    def add(self, n: int, s: float) -> None:
        self.tokens += n
        self.seconds += s

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_bench(
    engine: Engine,
    prompts: Sequence[tuple[str, list[int]]],
    candidates: Sequence[Candidate],
    cfg: BenchConfig,
    eos_ids: tuple[int, ...] = (),
    peers: Sequence[Peer] = (),
    progress: ProgressFn | None = None,
) -> BenchResult:
    """Benchmark ``prompts`` (id, token ids): the AR reference, each candidate, each peer,
    interleaved per prompt; ``cfg.repeats`` timed rounds, medians reported."""
    if not prompts:
        raise ConfigError("no prompts to benchmark")
    warm_gen = GenerationConfig(max_new_tokens=min(8, cfg.max_new_tokens), stop_on_eos=False)
    engine.generate(prompts[0][1], warm_gen, eos_ids=eos_ids)
    for c in candidates:
        engine.generate(
            prompts[0][1], warm_gen, drafter=c.make_drafter(), spec=c.spec, eos_ids=eos_ids
        )
    for peer in peers:
        peer.generate(prompts[0][1], warm_gen.max_new_tokens, ())
    col = _Collected(candidates, peers)
    for rnd in range(cfg.repeats):
        _bench_round(engine, prompts, candidates, peers, cfg, eos_ids, col, rnd, progress)
    ar_tok_s = statistics.median(col.rounds_ar)
    results = [
        _candidate_result(
            c,
            col.runs[c.name],
            check(col.refs, col.outs[c.name], strict=cfg.strict),
            col.rounds_c[c.name],
            ar_tok_s,
            col.rounds_ar,
        )
        for c in candidates
    ]
    n = len(prompts)
    return BenchResult(
        n_prompts=n,
        max_new_tokens=cfg.max_new_tokens,
        ar_tok_s=ar_tok_s,
        candidates=results,
        peers={
            name: PeerStats(statistics.median(col.rounds_peer[name]), same == n, same, n)
            for name, same in col.peer_ident.items()
        },
        rounds_ar_tok_s=col.rounds_ar,
        tokens_generated=sum(len(r.tokens) for r in col.refs),
    )


class _Collected:
    """What the rounds of :func:`run_bench` gather: references and outputs of the first round,
    tokens/s per round."""

    def __init__(self, candidates: Sequence[Candidate], peers: Sequence[Peer]) -> None:
        self.refs: list[Reference] = []
        self.outs: dict[str, dict[str, list[int]]] = {c.name: {} for c in candidates}
        self.runs: dict[str, list[GenerationResult]] = {c.name: [] for c in candidates}
        self.peer_ident: dict[str, int] = {p.name: 0 for p in peers}
        self.rounds_ar: list[float] = []
        self.rounds_c: dict[str, list[float]] = {c.name: [] for c in candidates}
        self.rounds_peer: dict[str, list[float]] = {p.name: [] for p in peers}


def _bench_round(
    engine: Engine,
    prompts: Sequence[tuple[str, list[int]]],
    candidates: Sequence[Candidate],
    peers: Sequence[Peer],
    cfg: BenchConfig,
    eos_ids: tuple[int, ...],
    col: _Collected,
    rnd: int,
    progress: ProgressFn | None,
) -> None:
    """One timed round: per prompt the reference, then every candidate, then every peer."""
    first = rnd == 0
    gen = generation(cfg.max_new_tokens, cfg.stop_on_eos, cfg.sampling)
    ref_gen = generation(cfg.max_new_tokens, cfg.stop_on_eos, cfg.sampling, margins=True)
    drafters = {c.name: c.make_drafter() for c in candidates}
    ar = _Tally()
    ct = {c.name: _Tally() for c in candidates}
    pt = {p.name: _Tally() for p in peers}
    for i, (pid, ids) in enumerate(prompts):
        t = time.perf_counter()
        ref = engine.generate(ids, ref_gen if first else gen, eos_ids=eos_ids)
        ar.add(len(ref.tokens), time.perf_counter() - t)
        if first:
            col.refs.append(Reference(pid, tuple(ref.tokens), tuple(ref.margins)))
        for c in candidates:
            t = time.perf_counter()
            res = engine.generate(ids, gen, drafter=drafters[c.name], spec=c.spec, eos_ids=eos_ids)
            ct[c.name].add(len(res.tokens), time.perf_counter() - t)
            if first:
                col.outs[c.name][pid] = res.tokens
                col.runs[c.name].append(res)
        for peer in peers:
            t = time.perf_counter()
            toks = peer.generate(ids, cfg.max_new_tokens, eos_ids if cfg.stop_on_eos else ())
            pt[peer.name].add(len(toks), time.perf_counter() - t)
            if first:
                col.peer_ident[peer.name] += int(list(toks) == ref.tokens)
        if progress is not None:
            progress(pid, rnd * len(prompts) + i + 1, cfg.repeats * len(prompts))
    col.rounds_ar.append(ar.tok_s)
    for name, tally in ct.items():
        col.rounds_c[name].append(tally.tok_s)
    for name, tally in pt.items():
        col.rounds_peer[name].append(tally.tok_s)


def _candidate_result(
    c: Candidate,
    runs: list[GenerationResult],
    forcing: ForcingReport,
    rounds: list[float],
    ar_tok_s: float,
    ar_rounds: list[float],
) -> CandidateResult:
    steps = sum(r.steps for r in runs)
    accepted = sum(sum(r.accept_lengths) for r in runs)
    by_depth = [
        sum(sum(a >= d for a in r.accept_lengths) for r in runs) / steps if steps else 0.0
        for d in range(1, c.spec.max_depth + 1)
    ]
    tok_s = statistics.median(rounds) if forcing.ok else None
    return CandidateResult(
        name=c.name,
        drafter=c.drafter,
        tree=asdict(c.spec),
        spec_tok_s=tok_s,
        speedup=tok_s / ar_tok_s if tok_s else None,
        tau=(accepted + steps) / steps if steps else 1.0,
        acceptance_by_depth=by_depth,
        mean_draft_nodes=sum(sum(r.draft_nodes) for r in runs) / steps if steps else 0.0,
        draft_ms_per_step=1e3 * sum(r.draft_s for r in runs) / steps if steps else 0.0,
        lossless=forcing.ok,
        mismatches=len(forcing.divergences),
        forcing=forcing,
        rounds_tok_s=rounds,
        rounds_speedup=[s / a for s, a in zip(rounds, ar_rounds, strict=True) if a > 0]
        if forcing.ok
        else [],
    )
