"""Choosing: a round's directions and candidates, and Phase 1's winners (pure functions).

* :func:`order_directions` - factors largest first; a direction that already came up empty on
  this very plan goes after the others;
* :func:`n_directions` - the first direction, plus the second when within ``near_tie`` of it;
* :func:`choose` - every explorer in turn (an extra explorer's candidates first, the built-in
  one fills the round), each candidate keyed for idempotency; the journal's ``candidates``;
* :func:`pick_winners` - PASS trials faster than ``1 + min_gain``, the best params per
  mechanism, fastest first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from specpilot.pilot.config import directions, plan_hash, trial_key
from specpilot.pilot.explorer import Explorer, RoundAsk
from specpilot.pilot.records import (
    CandidatesRecord,
    Change,
    Item,
    PlanJSON,
    RoundSummary,
    TrialRecord,
)
from specpilot.pilot.search import canonical
from specpilot.pilot.trial import PASS, TrialResult


def order_directions(factors: Mapping[str, float], near_tie: float, plan: PlanJSON,
                     rounds: Sequence[RoundSummary]) -> list[str]:  # fmt: skip
    """Directions largest factor first; those that kept nothing on this plan before go last."""
    h = plan_hash(plan)
    fruitless = {d for r in rounds if r.base == h and not r.kept for d in r.directions}
    return sorted(directions(factors, near_tie), key=lambda f: f in fruitless)


def n_directions(factors: Mapping[str, float], order: Sequence[str], near_tie: float) -> int:
    top = factors.get(order[0], 1.0)
    near = len(order) > 1 and factors.get(order[1], 1.0) >= top * (1 - near_tie)
    return 2 if near else 1


def tried_on(trials: Sequence[TrialRecord], plan: PlanJSON) -> set[str]:
    """Canonical keys of the mechanisms already tried on ``plan``."""
    h = plan_hash(plan)
    return {canonical(t.steps[-1][0], t.steps[-1][1]) for t in trials if t.steps and t.base == h}


def choose(run_id: str, ask: RoundAsk, explorers: Sequence[Explorer],
           logs: bool) -> CandidatesRecord:  # fmt: skip
    """The round's candidates from ``explorers`` in order; ``logs``: journal the explorers'
    logs (an extra explorer runs)."""
    items: list[Item] = []
    chosen: list[str] = []
    log: list[dict[str, Any]] = []
    for ex in explorers:
        got = ex.propose(replace(ask, want=ask.want - len(items), have=len(items)))
        for it in got.items:
            key = trial_key(run_id, ask.round, "explore", ask.plan, it.steps)
            items.append(replace(it, key=key))
        log.extend(got.log or [])
        chosen += [d for d in got.directions if d not in chosen]
    chosen += [d for d in dict.fromkeys(it.direction for it in items) if d not in chosen]
    return CandidatesRecord(ask.round, chosen, items, log if logs else None)


def pick_winners(items: Sequence[Item], results: Mapping[str, TrialResult], min_gain: float,
                 limit: int) -> list[Change]:  # fmt: skip
    """Phase 1 winners for Phase 2: PASS trials faster than ``1 + min_gain``, the best params per
    mechanism, fastest first, at most ``limit``."""
    best: dict[str, Change] = {}
    for it in items:
        r = results.get(it.key)
        if r is None or r.status != PASS or r.speedup is None or r.speedup <= 1 + min_gain:
            continue
        w = Change(it.mechanism, it.params, r.speedup, r.spread or 0.0, it.key)
        if it.mechanism not in best or w.speedup > best[it.mechanism].speedup:
            best[it.mechanism] = w
    return sorted(best.values(), key=lambda w: -w.speedup)[:limit]
