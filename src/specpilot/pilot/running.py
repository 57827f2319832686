"""Running: trials and profiles through the executor, inside the budget, until asked to stop.

:class:`Runner` owns the prompt pools (tuning, held-back, timed rounds), the trusted references,
the timing slot and the executor. It builds jobs, dispatches them (explore trials in parallel,
whole-pool trials one at a time) and hands every finished result to a ``record`` callback before
the next step. It never starts work the budget cannot pay for (:func:`estimate`), and once the
stop event is set (the first SIGINT) it starts nothing new: the trials in flight end INTERRUPTED
(the executor's abort) and are recorded as such.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specpilot.mechanisms.base import FACTORS
from specpilot.pilot.config import PROFILE_KEYS, OptimizeConfig
from specpilot.pilot.events import EventFn, ReferenceProgress, TrialStart
from specpilot.pilot.executors import Executor
from specpilot.pilot.proc import TimingSlot
from specpilot.pilot.records import Item, PlanJSON, ProfileRecord, Steps, TrialRecord
from specpilot.pilot.reference import ReferenceCache
from specpilot.pilot.trial import (
    ChildSpec,
    ProfileJob,
    PromptCase,
    TrialJob,
    TrialLimits,
    TrialResult,
)

Prompts = list[tuple[str, list[int]]]
SpecOf = Callable[[Mapping[str, Any], Sequence[tuple[str, Any]]], ChildSpec]
Record = Callable[[int, str, str, PlanJSON, Steps, TrialResult], TrialResult]
"""``record(round, kind, key, base_plan, steps, result)``: journal, memory, state; returns it."""


class OutOfBudget(Exception):
    """The budget ran out while computing references (nothing is lost: they are cached)."""


class Clock:
    """Run seconds summed over sessions, and what is left of the budget."""

    def __init__(self, budget_minutes: float, elapsed0: float = 0.0) -> None:
        self.budget_s, self.elapsed0, self.t0 = budget_minutes * 60, elapsed0, time.monotonic()

    def elapsed(self) -> float:
        return self.elapsed0 + time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()


@dataclass(frozen=True)
class Pools:
    """The workload split: tuning prompts (profiles, timing) and held-back ones (forcing)."""

    tuning: Prompts
    held: Prompts
    timed: list[Prompts]
    """Rounds of timed prompts (cut per run, :class:`~.config.TimedPromptCut`)."""

    @property
    def timed_flat(self) -> Prompts:
        return [p for r in self.timed for p in r]


def estimate(what: str, profiles: Sequence[ProfileRecord], trials: Sequence[TrialRecord]) -> float:
    """Seconds a profile, an explore trial or a whole-pool trial is expected to take."""
    if what == "profile":
        return min(profiles[-1].seconds, 240.0) if profiles else 60.0
    kind = "integrate" if what == "integrate" else "explore"
    durs = [t.result.duration_s for t in trials if t.kind == kind]
    if durs:
        return sum(durs[-6:]) / len(durs[-6:])
    return 90.0 if what == "integrate" else 45.0


class Runner:
    def __init__(self, cfg: OptimizeConfig, out: Path, executor: Executor, refs: ReferenceCache,
                 pools: Pools, clock: Clock, stop: threading.Event, emit: EventFn,
                 spec_of: SpecOf) -> None:  # fmt: skip
        self.cfg, self.out, self.executor, self.refs = cfg, out, executor, refs
        self.pools, self.clock, self.stop = pools, clock, stop
        self.emit, self.spec_of = emit, spec_of
        self.slot = str(out / ".slots" / cfg.device.replace(":", "_")) if (
            cfg.device == "cpu" or cfg.workers > 1
        ) else None  # fmt: skip
        self.forcing_cursor = 0

    def references(self, prompts: Prompts) -> dict[str, PromptCase]:
        """Trusted references of ``prompts`` (decoded here when missing); OutOfBudget when the
        budget runs out or a stop is requested first."""
        missing = self.refs.missing(prompts)
        for i, (pid, ids) in enumerate(missing):
            if self.clock.left() <= 0 or self.stop.is_set():
                raise OutOfBudget
            self.emit("reference", ReferenceProgress(i, len(missing), pid))
            with TimingSlot(self.slot).shared():  # never while another trial is being timed
                self.refs.get(pid, ids)
        return {pid: PromptCase(pid, tuple(ids), self.refs.get(pid, ids)) for pid, ids in prompts}

    def limits(self) -> TrialLimits:
        """The configured limits, capped so a trial ends at most a minute after the budget."""
        cap = max(self.clock.left(), 0.0) + 60.0
        lim = self.cfg.limits
        return replace(lim, trial_timeout_s=min(lim.trial_timeout_s, cap),
                       setup_timeout_s=min(lim.setup_timeout_s, cap),
                       request_timeout_s=min(lim.request_timeout_s, cap))  # fmt: skip

    def forcing_sample(self) -> Prompts:
        """The next ``forcing_prompts`` held-back prompts (rotating through the pool)."""
        held = self.pools.held
        n = min(self.cfg.forcing_prompts, len(held))
        out = [held[(self.forcing_cursor + i) % len(held)] for i in range(n)]
        self.forcing_cursor = (self.forcing_cursor + n) % len(held)
        return out

    def profile(self, rnd: int, plan: PlanJSON, run_id: str) -> ProfileRecord:
        """Phase 0 of ``plan`` in a trial child (not yet recorded)."""
        cfg = self.cfg
        prompts = self.pools.tuning[: cfg.profile_prompts]
        self.emit("profile_start", rnd)
        t = time.monotonic()
        job = ProfileJob(
            f"{run_id}/r{rnd}/profile", self.spec_of(plan, ()),
            tuple((pid, tuple(ids)) for pid, ids in prompts), dict(cfg.profile_config),
            int(cfg.profile_config.get("max_new_tokens", cfg.max_new_tokens)), cfg.stop_on_eos,
            self.limits(), self.slot, str(self.out / "trials"), tuple(prompts[0][1][:8]),
        )  # fmt: skip
        status, reason, rep = self.executor.profile(job)
        rec = ProfileRecord(rnd, status, reason, time.monotonic() - t)
        if rep is not None:
            rec.factors = {f: rep[f"{f}_factor"] for f in FACTORS}
            rec.report = {k: rep.get(k) for k in PROFILE_KEYS}
        return rec

    def job(self, key: str, base: PlanJSON, steps: Steps, forcing: Prompts) -> TrialJob:
        cases = self.references([*forcing, *self.pools.timed_flat])
        cfg = self.cfg
        return TrialJob(
            key, self.spec_of(base, [(m, p) for m, p in steps]), self.spec_of(base, ()),
            tuple(cases[pid] for pid, _ in forcing),
            tuple(tuple(cases[pid] for pid, _ in r) for r in self.pools.timed),
            cfg.max_new_tokens, cfg.stop_on_eos, self.limits(), self.slot,
            str(self.out / "trials"), tuple(self.pools.tuning[0][1][:8]),
        )  # fmt: skip

    def _can_start(self, forcing: Prompts, est: float) -> bool:
        """References ready and the budget left for one more trial, and no stop requested."""
        if self.stop.is_set():
            return False
        try:  # the references first: they take time too
            self.references([*forcing, *self.pools.timed_flat])
        except OutOfBudget:
            return False
        return self.clock.left() >= est and not self.stop.is_set()

    def explore(self, rnd: int, plan: PlanJSON, items: Sequence[Item],
                done: dict[str, TrialResult], est: float, record: Record
                ) -> dict[str, TrialResult] | None:  # fmt: skip
        """Phase 1: ``items`` not yet ``done`` as parallel trials. None when nothing could run,
        or when a stop was requested (the round is then incomplete)."""
        done = dict(done)
        todo = [it for it in items if it.key not in done]
        futures: dict[Future[TrialResult], Item] = {}
        while todo or futures:
            while todo and len(futures) < self.executor.workers:
                forcing = self.forcing_sample()
                if not self._can_start(forcing, est):
                    todo = []
                    break
                it = todo.pop(0)
                job = self.job(it.key, plan, it.steps, forcing)
                self.emit("trial_start", TrialStart(rnd, "explore", it))
                futures[self.executor.submit(job)] = it
            if not futures:
                break
            finished, _ = wait(list(futures), return_when=FIRST_COMPLETED)
            for fut in finished:
                it = futures.pop(fut)
                done[it.key] = record(rnd, "explore", it.key, plan, it.steps, fut.result())
        if self.stop.is_set() or (any(it.key not in done for it in items) and not done):
            return None
        return done

    def full_pool(self, rnd: int, kind: str, item: Item, base: PlanJSON, steps: Steps,
                  done: Mapping[str, TrialResult], est: float, record: Record
                  ) -> TrialResult | None:  # fmt: skip
        """``steps`` on ``base`` forced on the whole held-back pool and timed (or its recorded
        result after a resume); None when the budget cannot pay for it or a stop was requested
        (also when it was interrupted)."""
        res = done.get(item.key)
        if res is not None:
            return res
        if not self._can_start(self.pools.held, est):
            return None
        job = self.job(item.key, base, steps, self.pools.held)
        self.emit("trial_start", TrialStart(rnd, kind, item))
        res = record(rnd, kind, item.key, base, steps, self.executor.submit(job).result())
        return None if self.stop.is_set() else res
