"""Side-by-side benchmark: plain AR vs speculative decoding (and optional peers), token-forced.

Protocol (the same for every figure in BENCHMARKS.md):
  1. warm-up: a short AR and speculative generation on the first prompt (not timed);
  2. round 1: per prompt, interleaved, AR (the reference, with logit margins), speculative, then
     each peer; the speculative outputs and the peers' outputs are compared token by token with
     the reference (token forcing) before any speed is reported;
  3. rounds 2..R: the same, timed only; each round gets a fresh drafter, so nothing a drafter
     learned from an earlier round's outputs carries over.
Speed = generated tokens / wall time of the generate calls (prefill included), per round;
the reported figure is the median over rounds. A speculative run that fails forcing gets no
speed figure (``spec_tok_s`` and ``speedup`` are None).
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

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ConfigError(f"--max-new-tokens must be positive, got {self.max_new_tokens}")
        if self.repeats <= 0:
            raise ConfigError(f"--repeats must be positive, got {self.repeats}")


@dataclass
class PeerStats:
    tok_s: float
    identical: bool
    """Every prompt's tokens equal our AR reference."""
    n_identical: int
    n_prompts: int


@dataclass
class BenchResult:
    drafter: str
    tree: dict[str, Any]
    n_prompts: int
    max_new_tokens: int
    ar_tok_s: float
    spec_tok_s: float | None
    speedup: float | None
    tau: float
    acceptance_by_depth: list[float]
    mean_draft_nodes: float
    draft_ms_per_step: float
    lossless: bool
    mismatches: int
    forcing: ForcingReport
    peers: dict[str, PeerStats] = field(default_factory=dict)
    rounds_ar_tok_s: list[float] = field(default_factory=list)
    rounds_spec_tok_s: list[float] = field(default_factory=list)
    tokens_generated: int = 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["forcing"] = {
            "status": self.forcing.status,
            "summary": self.forcing.summary(),
            "divergences": [asdict(x) for x in self.forcing.divergences],
        }
        d["peers"] = {k: asdict(v) for k, v in self.peers.items()}
        return d


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
    make_drafter: Callable[[], Drafter | None],
    spec: TreeSpec,
    cfg: BenchConfig,
    drafter_name: str = "none",
    eos_ids: tuple[int, ...] = (),
    peers: Sequence[Peer] = (),
    progress: ProgressFn | None = None,
) -> BenchResult:
    """Benchmark ``prompts`` (id, token ids). ``make_drafter`` builds a fresh drafter per round."""
    if not prompts:
        raise ConfigError("no prompts to benchmark")
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, stop_on_eos=cfg.stop_on_eos)
    ref_gen = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens, stop_on_eos=cfg.stop_on_eos, record_margins=True
    )
    warm = make_drafter()
    warm_gen = GenerationConfig(max_new_tokens=min(8, cfg.max_new_tokens), stop_on_eos=False)
    engine.generate(prompts[0][1], warm_gen, eos_ids=eos_ids)
    if warm is not None:
        engine.generate(prompts[0][1], warm_gen, drafter=warm, spec=spec, eos_ids=eos_ids)

    refs: list[Reference] = []
    spec_out: dict[str, list[int]] = {}
    spec_runs: list[GenerationResult] = []
    peer_ident: dict[str, int] = {p.name: 0 for p in peers}
    rounds_ar: list[float] = []
    rounds_spec: list[float] = []
    rounds_peer: dict[str, list[float]] = {p.name: [] for p in peers}
    total = cfg.repeats * len(prompts)
    for rnd in range(cfg.repeats):
        drafter = make_drafter()
        ar, sp = _Tally(), _Tally()
        pt = {p.name: _Tally() for p in peers}
        for i, (pid, ids) in enumerate(prompts):
            first = rnd == 0
            t = time.perf_counter()
            ref = engine.generate(ids, ref_gen if first else gen, eos_ids=eos_ids)
            ar.add(len(ref.tokens), time.perf_counter() - t)
            if first:
                refs.append(Reference(pid, tuple(ref.tokens), tuple(ref.margins)))
            if drafter is not None:
                t = time.perf_counter()
                res = engine.generate(ids, gen, drafter=drafter, spec=spec, eos_ids=eos_ids)
                sp.add(len(res.tokens), time.perf_counter() - t)
                if first:
                    spec_out[pid] = res.tokens
                    spec_runs.append(res)
            for peer in peers:
                t = time.perf_counter()
                toks = peer.generate(ids, cfg.max_new_tokens, eos_ids if cfg.stop_on_eos else ())
                pt[peer.name].add(len(toks), time.perf_counter() - t)
                if first:
                    peer_ident[peer.name] += int(list(toks) == ref.tokens)
            if progress is not None:
                progress(pid, rnd * len(prompts) + i + 1, total)
        rounds_ar.append(ar.tok_s)
        if drafter is not None:
            rounds_spec.append(sp.tok_s)
        for name, tally in pt.items():
            rounds_peer[name].append(tally.tok_s)

    if not spec_runs:  # no drafter: the AR reference is compared with itself
        spec_out = {r.prompt_id: list(r.tokens) for r in refs}
    forcing = check(refs, spec_out, strict=cfg.strict)
    ar_tok_s = statistics.median(rounds_ar)
    spec_tok_s = statistics.median(rounds_spec) if rounds_spec and forcing.ok else None
    steps = sum(r.steps for r in spec_runs)
    accepted = sum(sum(r.accept_lengths) for r in spec_runs)
    depth = spec.max_depth
    by_depth = [
        sum(sum(a >= d for a in r.accept_lengths) for r in spec_runs) / steps if steps else 0.0
        for d in range(1, depth + 1)
    ]
    return BenchResult(
        drafter=drafter_name,
        tree=asdict(spec),
        n_prompts=len(prompts),
        max_new_tokens=cfg.max_new_tokens,
        ar_tok_s=ar_tok_s,
        spec_tok_s=spec_tok_s,
        speedup=spec_tok_s / ar_tok_s if spec_tok_s else None,
        tau=(accepted + steps) / steps if steps else 1.0,
        acceptance_by_depth=by_depth,
        mean_draft_nodes=sum(sum(r.draft_nodes) for r in spec_runs) / steps if steps else 0.0,
        draft_ms_per_step=1e3 * sum(r.draft_s for r in spec_runs) / steps if steps else 0.0,
        lossless=forcing.ok,
        mismatches=len(forcing.divergences),
        forcing=forcing,
        peers={
            name: PeerStats(
                statistics.median(rounds_peer[name]),
                peer_ident[name] == len(prompts),
                peer_ident[name],
                len(prompts),
            )
            for name in peer_ident
        },
        rounds_ar_tok_s=rounds_ar,
        rounds_spec_tok_s=rounds_spec,
        tokens_generated=sum(len(r.tokens) for r in refs),
    )
