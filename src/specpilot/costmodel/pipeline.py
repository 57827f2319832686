"""``profile``: one pass that measures everything the three factors need.

Protocol (all on the same prompts, the same engine):
  0. hardware peaks (table or cached calibration), a warm-up;
  1. per prompt, the AR reference, the plan without the profiler and the plan under
     torch.profiler, each plan run token-forced against the reference (:mod:`.runs`: a lossy
     plan stops the profile there, with the forcing report); the profiler's own cost per event
     is the profiled run's extra wall time per step over the plain run's, divided by the events
     it recorded (:func:`.measure.profiler_cost_per_event`);
  2. exact replay of a fourth drafter along the references (tau_bf(N), tau_opt(N)), timing its
     ``propose`` at budget N on a sample of positions; the same for every alternative drafter
     (best-first and the plan's trees only), so the tau factor sees a better drafter too;
  3. the verify step at width N + 1 for every N of the grid, at the mean context length;
  4. roofline floors from the model config and the measured step shape; the factors, pure
     functions of these measurements (:mod:`.factors`); sensitivity.
With no drafter (plain AR) there is nothing to replay: tau is 1, the grid is {0}, N* = 0.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

from specpilot.costmodel.factors import (
    direction,
    kernel_factor,
    overhead_factor,
    tau_factor,
    tau_ratio,
)
from specpilot.costmodel.hardware import Hardware, detect, floors_checked
from specpilot.costmodel.measure import (
    ClassTimes,
    profiled,
    profiler_cost_per_event,
    time_verify,
)
from specpilot.costmodel.replay import (
    PromptReplay,
    ReplaySpecs,
    TauCurves,
    budget_grid,
    replay_prompt,
    tau_curves,
    time_proposes,
)
from specpilot.costmodel.report import (
    BudgetPoint,
    CostReport,
    DrafterPoint,
    kernel_rows,
    row_times,
    sensitivity,
)
from specpilot.costmodel.roofline import (
    ALL_CLASSES,
    ZERO,
    Dtypes,
    StepShape,
    Work,
    draft_model_work,
    native_int8_share,
    native_weight_bytes,
    prefill_work,
    step_work,
    trained_drafter_work,
    trained_net,
)
from specpilot.costmodel.runs import Forcing, LossyPlanError, ProgressFn, Runs, timed_runs
from specpilot.drafters.base import Drafter
from specpilot.engine import Engine, GenerationConfig, GenerationResult
from specpilot.errors import ConfigError
from specpilot.model import Transformer
from specpilot.tree import TreeSpec

__all__ = ["LossyPlanError", "ProfileConfig", "ProgressFn", "profile"]


@dataclass(frozen=True)
class ProfileConfig:
    """Knobs of one profile; validated here (the CLI passes flags straight through)."""

    max_new_tokens: int = 128
    stop_on_eos: bool = True
    max_budget: int = 128
    """Largest node budget N of the replay grid (1, 2, 4, 8, 12, 16, 24, ... 128)."""
    replay_depth: int = 32
    """Depth of the wide tree and the chain that join the replay's candidate set."""
    wide_topk: int = 8
    """Children per node of the wide replay tree."""
    alpha: float = 0.60
    """Share of peak FLOP/s a floor assumes."""
    beta: float = 0.90
    """Share of peak bandwidth a floor assumes."""
    sensitivity: float = 0.20
    """Relative move of alpha and beta in the sensitivity analysis."""
    verify_repeats: int = 5
    """Timed repeats (median) of the verify step per budget."""
    draft_samples: int = 48
    """Positions at which the drafter's ``propose`` is timed per budget."""
    strict: bool = True
    """Token forcing of the plan's runs: any divergence from plain decoding stops the profile
    (False: near-ties, a reference margin below ``near_tie``, are tolerated)."""
    near_tie: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_budget", "replay_depth", "wide_topk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("verify_repeats", "draft_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("alpha", "beta"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.sensitivity < 1.0:
            raise ConfigError(f"sensitivity must be in [0, 1), got {self.sensitivity}")
        if self.near_tie < 0:
            raise ConfigError(f"near_tie must be >= 0, got {self.near_tie}")


def profile(
    engine: Engine,
    prompts: Sequence[tuple[str, list[int]]],
    make_drafter: Callable[[], Drafter | None],
    spec: TreeSpec | None = None,
    cfg: ProfileConfig | None = None,
    eos_ids: tuple[int, ...] = (),
    hardware: Hardware | None = None,
    progress: ProgressFn | None = None,
    alternatives: Mapping[str, Callable[[], Drafter | None]] | None = None,
) -> CostReport:
    """Split the gap to ideal of ``make_drafter()`` with ``spec`` into tau, kernel and overhead
    factors on ``prompts`` (id, token ids). ``make_drafter`` is called once per run (fresh
    state); returning None profiles plain AR decoding. ``hardware`` skips detection.

    ``alternatives``: other drafters that can be built here (name -> factory). Each is replayed
    along the same references with the plan's tree spec (best-first and the plan's own trees,
    its proposes timed); the tau factor then compares the plan against whichever drafter's
    oracle reaches the highest throughput (``CostReport.tau_drafter``), so a better drafter
    shows up as a tau gap. Ignored for plain decoding.

    Raises :class:`~specpilot.costmodel.runs.LossyPlanError` (with the forcing report) when the
    plan's output differs from plain decoding: a lossy plan is not timed."""
    t_start = time.perf_counter()
    cfg = cfg or ProfileConfig()
    spec = spec or TreeSpec()
    probe = make_drafter()
    plan_nodes = spec.max_nodes if probe is not None else 0
    _check_fits(engine, prompts, cfg, plan_nodes)
    phases = _Phases()
    with phases("setup"):
        hw = hardware or detect(engine.model.device, engine.model.dtype)
        _warm_up(engine, prompts[0][1], make_drafter, spec, cfg, eos_ids)
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, stop_on_eos=cfg.stop_on_eos)
    how = Forcing(cfg.strict, cfg.near_tie)
    with phases("runs"):
        runs = timed_runs(engine, prompts, make_drafter, spec, gen, eos_ids, how, progress)
    with phases("replay"):
        grid: tuple[int, ...] = (0,)
        replays: list[PromptReplay] = []
        draft_s: dict[int, list[float]] = {}
        if probe is not None:
            grid = (0, *budget_grid(cfg.max_budget, plan_nodes))
            replays, draft_s = _replay(
                engine, prompts, runs.refs, make_drafter, spec, cfg, grid, progress
            )
        curves = tau_curves(replays, grid)
    alts: dict[str, tuple[TauCurves, dict[int, list[float]]]] = {}
    if probe is not None and alternatives:
        with phases("replay_drafters"):
            for name, factory in alternatives.items():
                rep, ds = _replay(engine, prompts, runs.refs, factory, spec, cfg, grid, progress,
                                  narrow=True)  # fmt: skip
                alts[name] = (tau_curves(rep, grid), ds)
    with phases("step_cost"):
        ctx = round(statistics.mean(k for r in runs.plain for k in _cache_lens(r)))
        verify_ms = _verify_costs(engine, grid, ctx, cfg, progress)
        budgets = _budget_points(grid, curves, draft_s, verify_ms)
    points: list[DrafterPoint] = []  # none for plain decoding
    if probe is not None:
        points.append(_drafter_point(probe.name, budgets, False))
    for name, (c, ds) in alts.items():
        points.append(_drafter_point(name, _budget_points(grid, c, ds, verify_ms), True))
    report = _report(engine, prompts, runs, budgets, curves, hw, cfg, probe, spec, points)
    return replace(report, profile_s=time.perf_counter() - t_start, phases_s=phases.seconds)


def _drafter_point(name: str, budgets: Sequence[BudgetPoint], alternative: bool) -> DrafterPoint:
    """``name``'s throughput-optimal budget (ties: the smaller N)."""
    star = max(budgets, key=lambda b: (b.throughput, -b.n))
    return DrafterPoint(name, star.n, star.tau_opt, star.throughput, alternative)


class _Phases:
    """Wall time per named phase: ``with phases("runs"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - t


def _check_fits(
    engine: Engine, prompts: Sequence[tuple[str, list[int]]], cfg: ProfileConfig, plan_nodes: int
) -> None:
    """ConfigError unless every prompt, its new tokens and the widest tree fit the context."""
    if not prompts:
        raise ConfigError("no prompts to profile")
    longest = max(len(ids) for _, ids in prompts)
    need = longest + cfg.max_new_tokens + max(cfg.max_budget, plan_nodes) + 2
    if need > engine.context_len:
        raise ConfigError(
            f"prompts of up to {longest} tokens + {cfg.max_new_tokens} new tokens + a node budget "
            f"of {cfg.max_budget} exceed the model context of {engine.context_len}; lower "
            "--max-new-tokens or --max-budget"
        )


def _warm_up(
    engine: Engine,
    ids: list[int],
    make_drafter: Callable[[], Drafter | None],
    spec: TreeSpec,
    cfg: ProfileConfig,
    eos_ids: tuple[int, ...],
) -> None:
    """A short plain run, then a short profiled plan run: the first profiler session and ranges
    pay one-time setup costs."""
    warm = GenerationConfig(max_new_tokens=min(8, cfg.max_new_tokens), stop_on_eos=False)
    engine.generate(ids, warm, eos_ids=eos_ids)
    profiled(
        lambda: engine.generate(ids, warm, drafter=make_drafter(), spec=spec, eos_ids=eos_ids),
        engine.model.device,
    )


def _verify_costs(
    engine: Engine, grid: tuple[int, ...], ctx: int, cfg: ProfileConfig,
    progress: ProgressFn | None,
) -> list[float]:  # fmt: skip
    """Step 3: ms of the verify step at width N + 1 for every N of the grid, at ``ctx`` cached
    keys (median of ``cfg.verify_repeats``)."""
    for n in (grid[-1], grid[0]):  # warm-up: the widest call first, then the narrowest
        time_verify(engine, n, ctx, 1)
    out = []
    for i, n in enumerate(grid):
        out.append(1e3 * time_verify(engine, n, ctx, cfg.verify_repeats))
        if progress is not None:
            progress("step cost", i + 1, len(grid))
    return out


def _budget_points(
    grid: tuple[int, ...], curves: TauCurves, draft_s: dict[int, list[float]],
    verify_ms: Sequence[float],
) -> list[BudgetPoint]:  # fmt: skip
    """One drafter's points: its replayed curves, the shared verify cost, its mean propose time
    at each N."""
    out = []
    for i, n in enumerate(grid):
        ds = draft_s.get(n, [])
        mean_ms = 1e3 * statistics.mean(ds) if ds else 0.0
        out.append(BudgetPoint(n, curves.tau_opt[i], curves.tau_bf[i], verify_ms[i], mean_ms))
    return out


def _report(
    engine: Engine,
    prompts: Sequence[tuple[str, list[int]]],
    runs: Runs,
    budgets: list[BudgetPoint],
    curves: TauCurves,
    hw: Hardware,
    cfg: ProfileConfig,
    probe: Drafter | None,
    spec: TreeSpec,
    points: Sequence[DrafterPoint] = (),
) -> CostReport:
    """Step 4: floors, the three factors (:mod:`.factors`), sensitivity; the report.
    ``points``: every replayed drafter's N* point (the plan's first); the tau factor takes the
    oracle of the one with the highest throughput."""
    actual, profs, times = runs.plain, runs.profiled, runs.times
    steps = sum(r.steps for r in actual)
    prof_steps = sum(r.steps for r in profs)
    if steps == 0 or prof_steps == 0:
        raise ConfigError("no decode steps: every output ended at its first token")
    wall_step_s = sum(r.prefill_s + r.decode_s for r in actual) / steps
    prof_step_s = sum(r.prefill_s + r.decode_s for r in profs) / prof_steps
    per_event = (profiler_cost_per_event(wall_step_s, prof_step_s, prof_steps, times.all_events)
                 if engine.model.device.type == "cpu" else 0.0)  # fmt: skip
    star = max(budgets, key=lambda b: (b.throughput, -b.n))  # the plan's own N*
    best = max(points, key=lambda d: d.throughput) if points else None
    best_tau = best.tau_opt if best is not None else star.tau_opt
    work = _work(engine, prompts, actual, steps, times, prof_steps, probe, runs.draft_forwards)
    corrected = times.corrected(per_event)
    measured = {k: corrected.get(k, 0.0) / prof_steps + times.clocked.get(k, 0.0) / steps
                for k in ALL_CLASSES}  # fmt: skip
    hw, rows = floors_checked(  # a kernel beating its floor: re-calibrate, note it
        hw, lambda h: kernel_rows(work, measured, h, cfg.alpha, cfg.beta), engine.model.device,
        engine.model.dtype,
    )  # fmt: skip
    kf = kernel_factor(*row_times(rows))
    kernel_step_ms = sum(r.measured_ms for r in rows)
    of = overhead_factor(wall_step_s, 1e-3 * kernel_step_ms)
    decode_tokens = sum(len(r.tokens) - 1 for r in actual)
    tau_actual = decode_tokens / steps
    tf = tau_factor(tau_actual, best_tau)
    sens, stable = sensitivity(work, measured, hw, cfg.alpha, cfg.beta, tf, of, cfg.sensitivity)
    plan_nodes = spec.max_nodes if probe is not None else 0
    return CostReport(
        drafter=probe.name if probe is not None else "none",
        plan=asdict(spec) if probe is not None else {},
        n_prompts=len(prompts),
        decode_tokens=decode_tokens,
        steps=steps,
        tau_factor=tf,
        tau_factor_raw=tau_ratio(tau_actual, best_tau),
        kernel_factor=kf,
        overhead_factor=of,
        gap=tf * kf * of,
        direction=direction({"tau": tf, "kernel": kf, "overhead": of}),
        n_star=star.n,
        tau_actual=tau_actual,
        tau_actual_engine=sum(sum(r.accept_lengths) + r.steps for r in actual) / steps,
        tau_bf_at_plan=next((b.tau_bf for b in budgets if b.n == plan_nodes), 1.0),
        tau_replay_plan=curves.tau_plan,
        budgets=tuple(budgets),
        kernels=rows,
        wall_step_ms=1e3 * wall_step_s,
        kernel_step_ms=kernel_step_ms,
        hardware=hw,
        alpha=cfg.alpha,
        beta=cfg.beta,
        sensitivity=sens,
        direction_stable=stable,
        mismatches=runs.mismatches,
        profile_s=0.0,
        profiler=_profiler_stats(per_event, times, prof_steps, prof_step_s, kernel_step_ms,
                                 steps),
        forcing=runs.forcing[0].summary(),
        tau_drafter=best.drafter if best is not None else "",
        tau_drafters=tuple(points),
    )


def _profiler_stats(per_event: float, times: ClassTimes, prof_steps: int, prof_step_s: float,
                    kernel_step_ms: float, steps: int) -> dict[str, float]:  # fmt: skip
    """The profiler's own cost and the correction it led to (the report's ``profiler``);
    ``clocked_ms_per_step``: the classes a one-op forward timed with its own clock in the run
    without the profiler (nothing to correct there)."""
    clocked_ms = 1e3 * sum(times.clocked.get(k, 0.0) for k in ALL_CLASSES) / steps
    raw_ms = 1e3 * sum(times.seconds.get(k, 0.0) for k in ALL_CLASSES) / prof_steps + clocked_ms
    return {
        "per_event_us": 1e6 * per_event,
        "events_per_step": times.all_events / prof_steps,
        "profiled_wall_step_ms": 1e3 * prof_step_s,
        "raw_kernel_step_ms": raw_ms,
        "clocked_ms_per_step": clocked_ms,
        "correction_ms_per_step": raw_ms - kernel_step_ms,
        "profiled_steps": float(prof_steps),
    }


def _replay(
    engine: Engine,
    prompts: Sequence[tuple[str, list[int]]],
    refs: list[GenerationResult],
    make_drafter: Callable[[], Drafter | None],
    spec: TreeSpec,
    cfg: ProfileConfig,
    grid: tuple[int, ...],
    progress: ProgressFn | None,
    narrow: bool = False,
) -> tuple[list[PromptReplay], dict[int, list[float]]]:
    """Step 2: exact replay of a fresh drafter; propose times per budget on sampled positions.
    ``narrow``: only the best-first and the plan's own trees join the candidate set (an
    alternative drafter: no wide tree, no long chain)."""
    drafter = make_drafter()
    assert drafter is not None
    specs = ReplaySpecs.for_plan(spec, cfg.max_budget, cfg.replay_depth, cfg.wide_topk)
    if narrow:
        specs = specs.narrowed()
    bf = specs.best_first
    timed = {n: TreeSpec(kind="dynamic", budget=n, topk=bf.topk, depth=bf.depth) for n in grid if n}
    positions = sum(max(0, len(r.tokens) - 1) for r in refs)
    stride = max(1, positions // cfg.draft_samples)
    draft_s: dict[int, list[float]] = {n: [] for n in timed}
    seen = 0
    replays = []
    for i, ((_, ids), ref) in enumerate(zip(prompts, refs, strict=True)):
        taps = tuple(getattr(drafter, "hidden_layers", ()))
        hidden = engine.hidden_states([*ids, *ref.tokens], taps) if taps else ()

        def timer(c: int, tokens: list[int], p: int = len(ids), h: Any = hidden) -> None:
            nonlocal seen
            if seen % stride == 0:
                for n, s in time_proposes(drafter, tokens, p, timed, h).items():
                    draft_s[n].append(s)
            seen += 1

        replays.append(replay_prompt(drafter, ids, ref.tokens, specs, grid, timer, hidden))
        if progress is not None:
            progress(f"replay {drafter.name}" if narrow else "replay", i + 1, len(prompts))
    return replays, draft_s


def _cache_lens(res: GenerationResult) -> list[int]:
    """Cached keys (committed prefix, root excluded) at the start of every decode step."""
    out, c = [], res.prompt_len
    for a in res.accept_lengths:
        out.append(c)
        c += a + 1
    return out


def _work(
    engine: Engine,
    prompts: Sequence[tuple[str, list[int]]],
    actual: list[GenerationResult],
    steps: int,
    times: ClassTimes,
    prof_steps: int,
    drafter: Drafter | None,
    draft_forwards: int = 0,
) -> dict[str, Work]:
    """Roofline work per decode step of every class, in :data:`ALL_CLASSES` order."""
    model = engine.model
    size = model.dtype.itemsize
    native = native_weight_bytes(model)  # GGUF blocks: bytes as stored, not the fp32 size
    q8, head_q8 = native_int8_share(model)  # the int8 profile's integer GEMMs
    dt = Dtypes(
        weight=native[0] if native else size,
        act=size,
        cache=8 if engine.attention == "exact" else size,
        head_weight=native[1] if native else None,
        int8=q8,
        head_int8=head_q8,
    )
    rows, keys, row_keys = [], [], []
    for r in actual:
        for n, k in zip(r.draft_nodes, _cache_lens(r), strict=True):
            rows.append(n + 1)
            keys.append(k)
            row_keys.append((n + 1) * (k + n + 1))
    shape = StepShape(statistics.mean(rows), statistics.mean(row_keys), statistics.mean(keys))
    work = step_work(model.cfg, shape, dt)
    draft = ZERO
    draft_model = getattr(drafter, "model", None)
    if isinstance(draft_model, Transformer):
        fwd = times.draft_o_proj / draft_model.cfg.n_layers / prof_steps
        draft = draft_model_work(draft_model.cfg.n_params, fwd, draft_model.dtype.itemsize)
    elif (trained := trained_net(drafter)) is not None:  # head / block: its net per forward
        draft = trained_drafter_work(trained.net, draft_forwards / prof_steps)
    work["drafter"] = draft
    work["prefill"] = prefill_work(model.cfg, [len(ids) for _, ids in prompts], dt).scaled(
        1.0 / steps
    )
    return {k: work.get(k, ZERO) for k in ALL_CLASSES}
