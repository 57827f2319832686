"""The cost report: the three factors of the gap to ideal, the direction, the sensitivity.

  gap = tau factor x kernel factor x overhead factor       (SpecPilot, Phase 0)

The factors themselves are pure functions in :mod:`.factors` (definitions and worked examples
there):

* tau factor      = tau_opt(N*) / tau_actual, at least 1 (``tau_factor_raw`` keeps the ratio),
  where N* maximizes tau_opt(N) / step cost(N) (see :mod:`.replay`); with alternative drafters
  replayed too, tau_opt(N*) of whichever drafter's oracle reaches the highest throughput
  (``tau_drafter``), so a better drafter shows up as a tau gap;
* kernel factor   = sum over kernel classes of measured time / sum of roofline floors
  (see :mod:`.roofline`, :mod:`.measure`);
* overhead factor = wall-clock time per decode step / kernel time per step.

``direction`` is the name of the largest factor ("tau", "kernel" or "overhead"; ties go to the
earlier name). The sensitivity analysis recomputes the floors, the kernel factor and the direction
with alpha and beta each moved by -20%, 0, +20% (9 combinations).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from specpilot.costmodel.factors import FACTOR_NAMES, direction, kernel_factor
from specpilot.costmodel.hardware import Hardware
from specpilot.costmodel.roofline import Work, floor_s

__all__ = [
    "FACTOR_NAMES",
    "BudgetPoint",
    "CostReport",
    "DrafterPoint",
    "KernelRow",
    "SensitivityPoint",
    "direction",
    "kernel_factor",
    "kernel_rows",
    "row_times",
    "sensitivity",
]


@dataclass(frozen=True)
class KernelRow:
    """One kernel class, per decode step (prefill amortized over the decode steps)."""

    name: str
    flops: float
    bytes: float
    floor_ms: float
    measured_ms: float


@dataclass(frozen=True)
class BudgetPoint:
    """One node budget N of the replay grid."""

    n: int
    tau_opt: float
    tau_bf: float
    verify_ms: float
    """Target verify step at width N + 1 (median)."""
    draft_ms: float
    """Drafter ``propose`` at budget N (mean over sampled positions; 0 for N = 0)."""

    @property
    def step_ms(self) -> float:
        return self.verify_ms + self.draft_ms

    @property
    def throughput(self) -> float:
        """tau_opt(N) / step cost: tokens per second the oracle tree would reach."""
        return 1e3 * self.tau_opt / self.step_ms if self.step_ms > 0 else 0.0


@dataclass(frozen=True)
class DrafterPoint:
    """One drafter's throughput-optimal budget under exact replay (the plan's drafter, or another
    drafter that can be built here, replayed along the same references)."""

    drafter: str
    n: int
    """Its N*: the budget of highest oracle throughput (tau_opt(N) / step cost(N))."""
    tau_opt: float
    throughput: float
    """tok/s the oracle tree of this drafter would reach at ``n`` (verify + its own propose)."""
    alternative: bool = False
    """Another drafter than the plan's (``drafter`` is then a plan drafter name)."""


@dataclass(frozen=True)
class SensitivityPoint:
    alpha: float
    beta: float
    kernel_factor: float
    gap: float
    direction: str


@dataclass(frozen=True)
class CostReport:
    """Result of :func:`specpilot.costmodel.profile`; plain data, JSON via :meth:`to_json`."""

    drafter: str
    plan: dict[str, Any]
    n_prompts: int
    decode_tokens: int
    """Output tokens committed by decode steps (the first token of each prompt comes from
    prefill)."""
    steps: int
    """Decode steps of the plan's run."""
    tau_factor: float
    tau_factor_raw: float
    kernel_factor: float
    overhead_factor: float
    gap: float
    direction: str
    n_star: int
    tau_actual: float
    """decode_tokens / steps of the real run of the plan."""
    tau_actual_engine: float
    """``GenerationResult.tau`` pooled (counts accepted drafts past the length limit too)."""
    tau_bf_at_plan: float
    """tau_bf at the plan's node budget (equals tau_actual for a deterministic drafter and a
    dynamic plan)."""
    tau_replay_plan: float
    """Replay of the plan's own trees: equals tau_actual for a deterministic drafter (a check
    that the replay reproduces the engine)."""
    budgets: tuple[BudgetPoint, ...]
    kernels: tuple[KernelRow, ...]
    wall_step_ms: float
    kernel_step_ms: float
    hardware: Hardware
    alpha: float
    beta: float
    sensitivity: tuple[SensitivityPoint, ...]
    direction_stable: bool
    mismatches: int
    """Prompts whose speculative output differs from the reference and was tolerated as a
    near-tie (non-strict forcing only; any other divergence stops the profile with
    :class:`~specpilot.costmodel.runs.LossyPlanError`)."""
    profile_s: float
    """Wall time of the whole profile."""
    phases_s: dict[str, float] = field(default_factory=dict)
    profiler: dict[str, float] = field(default_factory=dict)
    """Profiler cost per event (us), events per step, the profiled run's wall time per step, raw
    and corrected kernel time per step (ms)."""
    forcing: str = ""
    """Token forcing of the plan's runs against plain decoding: the one-line summary."""
    tau_drafter: str = ""
    """The drafter whose oracle the tau factor compares against: the plan's own, or another
    drafter of ``tau_drafters`` whose oracle tree reaches a higher throughput."""
    tau_drafters: tuple[DrafterPoint, ...] = ()
    """Every replayed drafter's N* point, the plan's drafter first (just it, without
    alternatives; empty for plain decoding)."""

    @property
    def factors(self) -> dict[str, float]:
        return {
            "tau": self.tau_factor,
            "kernel": self.kernel_factor,
            "overhead": self.overhead_factor,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "drafter": self.drafter,
            "plan": self.plan,
            "n_prompts": self.n_prompts,
            "decode_tokens": self.decode_tokens,
            "steps": self.steps,
            "tau_factor": self.tau_factor,
            "tau_factor_raw": self.tau_factor_raw,
            "kernel_factor": self.kernel_factor,
            "overhead_factor": self.overhead_factor,
            "gap": self.gap,
            "direction": self.direction,
            "n_star": self.n_star,
            "tau_actual": self.tau_actual,
            "tau_actual_engine": self.tau_actual_engine,
            "tau_bf_at_plan": self.tau_bf_at_plan,
            "tau_replay_plan": self.tau_replay_plan,
            "tau_opt": [{"n": b.n, "tau": b.tau_opt} for b in self.budgets],
            "tau_bf": [{"n": b.n, "tau": b.tau_bf} for b in self.budgets],
            "step_cost": [
                {
                    "n": b.n,
                    "verify_ms": b.verify_ms,
                    "draft_ms": b.draft_ms,
                    "step_ms": b.step_ms,
                    "throughput_tok_s": b.throughput,
                }
                for b in self.budgets
            ],
            "kernels": [asdict(k) for k in self.kernels],
            "per": "decode step (prefill amortized over the decode steps)",
            "wall_step_ms": self.wall_step_ms,
            "kernel_step_ms": self.kernel_step_ms,
            "hardware": self.hardware.to_json(),
            "alpha": self.alpha,
            "beta": self.beta,
            "sensitivity": {
                "combinations": [asdict(s) for s in self.sensitivity],
                "direction_stable": self.direction_stable,
            },
            "mismatches": self.mismatches,
            "forcing": self.forcing,
            "tau_drafter": self.tau_drafter,
            "tau_drafters": [asdict(d) for d in self.tau_drafters],
            "profile_s": self.profile_s,
            "phases_s": self.phases_s,
            "profiler": self.profiler,
        }


def kernel_rows(
    work: dict[str, Work], measured_s: dict[str, float], hw: Hardware, alpha: float, beta: float
) -> tuple[KernelRow, ...]:
    """Per-class rows (per step): floors from ``work``, measured from ``measured_s``."""
    names = list(dict.fromkeys([*work, *measured_s]))
    rows = []
    for name in names:
        wk = work.get(name, Work(0.0, 0.0))
        fl = floor_s(wk, hw.peak_flops, hw.peak_bw, alpha, beta, hw.peak_flops_fp64, hw.int8_peak)
        rows.append(KernelRow(name, wk.flops, wk.bytes, 1e3 * fl, 1e3 * measured_s.get(name, 0.0)))
    return tuple(rows)


def row_times(rows: tuple[KernelRow, ...]) -> tuple[dict[str, float], dict[str, float]]:
    """(measured ms, floor ms) per class of ``rows``: the inputs of :func:`kernel_factor`."""
    return {r.name: r.measured_ms for r in rows}, {r.name: r.floor_ms for r in rows}


def sensitivity(
    work: dict[str, Work],
    measured_s: dict[str, float],
    hw: Hardware,
    alpha: float,
    beta: float,
    tau_f: float,
    overhead_f: float,
    rel: float = 0.2,
) -> tuple[tuple[SensitivityPoint, ...], bool]:
    """Kernel factor, gap and direction with alpha and beta each at (1 - rel, 1, 1 + rel)x;
    and whether the direction is the same in all 9 combinations."""
    points = []
    for ka in (1 - rel, 1.0, 1 + rel):
        for kb in (1 - rel, 1.0, 1 + rel):
            a, b = alpha * ka, beta * kb
            kf = kernel_factor(*row_times(kernel_rows(work, measured_s, hw, a, b)))
            d = direction({"tau": tau_f, "kernel": kf, "overhead": overhead_f})
            points.append(SensitivityPoint(a, b, kf, tau_f * kf * overhead_f, d))
    return tuple(points), len({p.direction for p in points}) == 1
