"""Recall: the remembered winners of similar contexts, stacked into one plan and tried first.

Memory ranks each mechanism's remembered effects by ``similarity x (speedup - spread)``
(:meth:`specpilot.pilot.memory.Memory.priors`). Before its first round, a run with such priors
applies the best one of every applicable mechanism to the start plan — weakest first, so the
strongest wins where two set the same field — and verifies and times the stacked plan as one
integration trial on the whole held-back pool. A stack that is lossless and faster by more than
its spread becomes the plan the rounds start from; otherwise the run goes on from the start
plan as if nothing was remembered. Either way the rounds after it explore as usual (the
remembered candidates also come first in Phase 1). Plain functions: :func:`recall_steps` picks
the stack, :func:`recall_round` runs it through a callback and returns the round's summary.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specpilot.errors import ConfigError
from specpilot.mechanisms.base import Context, Mechanism
from specpilot.pilot.config import plan_hash, trial_key
from specpilot.pilot.events import EventFn, RoundStart
from specpilot.pilot.journal import RunState
from specpilot.pilot.memory import Memory, Prior
from specpilot.pilot.records import Change, Item, Outcome, PlanJSON, RoundSummary, Steps
from specpilot.pilot.trial import TrialResult
from specpilot.plan import Plan

Apply = Callable[[Plan, str, Mapping[str, Any]], Plan]


def recall_steps(
    memory: Memory,
    mechs: Mapping[str, Mechanism],
    ctx: Context,
    plan: Plan,
    apply: Apply,
    min_score: float = 0.02,
) -> list[tuple[str, dict[str, Any]]]:
    """Steps ``[(mechanism, params), ...]`` of the best remembered prior per mechanism that
    applies to ``plan`` here and is worth at least ``min_score`` (similarity-weighted gain over
    1). Each step is checked by applying it (``apply`` raises ConfigError when it does not
    apply); a step that no longer applies once the earlier ones are in is dropped."""
    best: list[Prior] = []
    for m in mechs.values():
        if m.applicable(ctx, plan) is not None:
            continue
        for p in memory.priors(ctx, m.id, limit=1):
            if p.score - p.similarity >= min_score:  # similarity x (speedup - spread - 1)
                best.append(p)
    steps: list[tuple[str, dict[str, Any]]] = []
    current = plan
    for p in sorted(best, key=lambda p: (p.score, p.mechanism)):  # weakest first
        try:
            nxt = apply(current, p.mechanism, p.params)
        except ConfigError:
            continue
        if nxt.replace(mechanisms=()) == current.replace(mechanisms=()):  # already so: skip
            continue
        current = nxt
        steps.append((p.mechanism, dict(p.params)))
    return steps


def label(steps: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """How a recalled stack is named in logs: ``memory[a+b]``."""
    return "memory[" + "+".join(m for m, _ in steps) + "]"


def pending(enabled: bool, state: RunState) -> bool:
    """Recall runs once, before anything else of the first round (also after a resume that
    stopped inside it)."""
    return (enabled and state.round == 0 and state.current.profile is None
            and all(t.kind == "recall" for t in state.trials))  # fmt: skip


RunFullPool = Callable[[Item, Steps], "TrialResult | None"]
"""Runs a stacked trial on the whole held-back pool; None when it could not run."""


def recall_round(rnd: int, plan: PlanJSON, steps: Sequence[tuple[str, Mapping[str, Any]]],
                 run_id: str, run: RunFullPool, keep: Callable[[TrialResult], bool],
                 emit: EventFn) -> RoundSummary | None:  # fmt: skip
    """The recall round: ``steps`` (:func:`recall_steps`) stacked on ``plan`` and verified on the
    whole held-back pool as one trial. Its summary keeps the stack (the plan the child built)
    only if ``keep`` accepts the result; None when there is nothing to recall or the trial could
    not run (the run goes on from ``plan``)."""
    if not steps:
        return None
    job_steps: Steps = [[m, dict(p)] for m, p in steps]
    key = trial_key(run_id, rnd, "recall", plan, job_steps)
    item = Item(label(steps), {"steps": job_steps}, "memory", "memory", key)
    emit("round", RoundStart(rnd, {}, ["memory"], [item]))
    res = run(item, job_steps)
    if res is None:
        return None
    ok = keep(res) and res.speedup is not None
    kept = [Change(item.mechanism, item.params, res.speedup or 0.0, res.spread or 0.0, key,
                   item.source, item.direction)] if ok else []  # fmt: skip
    new_plan = res.plan if ok and res.plan else plan
    return RoundSummary(rnd, plan_hash(plan), new_plan, {}, ["memory"], kept, kept,
                        [Outcome.of(item, res)])  # fmt: skip
