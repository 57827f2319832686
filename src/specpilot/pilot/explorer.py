"""Explorers: who proposes a round's candidates. The :class:`Explorer` protocol and the
built-in explorer (memory priors, then Optuna, per direction).

The coordinator asks every explorer of the run in turn (an extra explorer first, such as the LLM
agents of :mod:`specpilot.agent`, which the CLI wires in through an :data:`ExplorerFactory`;
then the built-in one, which fills the round). This package never imports an extra explorer:
it only knows the protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from specpilot.mechanisms.base import Context, Mechanism
from specpilot.pilot.memory import Memory
from specpilot.pilot.records import Change, Item, PlanJSON, TrialRecord
from specpilot.pilot.search import Candidate, Search, propose_useful
from specpilot.pilot.trial import PASS, TrialResult
from specpilot.plan import Plan

Apply = Callable[[Plan, str, Mapping[str, Any]], Plan]
ChildExtras = tuple[tuple[str, ...], tuple[str, ...], str]
"""(extra mechanism modules, python path entries, sandbox JSON) of a trial child."""


@dataclass
class RoundAsk:
    """What an explorer is asked for one round."""

    round: int
    plan: PlanJSON
    factors: Mapping[str, float]
    report: Mapping[str, Any] | None
    """The cost model's report summary of the round's profile."""
    order: tuple[str, ...]
    """Directions in exploration order (:func:`specpilot.pilot.choosing.order_directions`)."""
    n_directions: int
    """How many directions the round explores (1, or 2 on a near tie)."""
    want: int
    """Candidates still wanted this round."""
    have: int = 0
    """Candidates explorers asked earlier already proposed."""
    tried: set[str] = field(default_factory=set)
    """Canonical keys tried on this plan; explorers add what they propose."""


@dataclass
class Proposals:
    items: list[Item]
    """Candidates (keys are set by the chooser)."""
    directions: list[str] = field(default_factory=list)
    """The directions this explorer chose, in order."""
    log: list[dict[str, Any]] | None = None
    """Free-form log entries of the explorer (journaled with the round's candidates)."""


class Explorer(Protocol):
    """Proposes candidates each round and hears how they did."""

    @property
    def level(self) -> str:
        """The sandbox level its candidates' children run under ("" = no untrusted code)."""

    def propose(self, ask: RoundAsk) -> Proposals: ...

    def child_extras(self, plan: Mapping[str, Any], steps: Sequence[tuple[str, Any]]
                     ) -> ChildExtras: ...  # fmt: skip

    def after_round(self, rnd: int, items: Sequence[Item], results: Mapping[str, TrialResult],
                    kept: Sequence[Change]) -> list[dict[str, Any]]: ...  # fmt: skip


@dataclass(frozen=True)
class ExplorerSetup:
    """What a factory gets to start an extra explorer for a run."""

    cfg: Any
    """The run's :class:`~specpilot.pilot.config.OptimizeConfig`."""
    out: Path
    run_id: str
    memory: Memory
    mechs: dict[str, Mechanism]
    """The run's mechanisms by id (an explorer may register stand-ins here)."""
    ctx_of: Callable[[Mapping[str, Any]], Context]
    log: Callable[[dict[str, Any]], None]
    """Appends a record to the run's journal."""
    records: Sequence[Mapping[str, Any]]
    """The journal so far (a resumed run)."""
    plan: PlanJSON


ExplorerFactory = Callable[[ExplorerSetup], "Explorer | None"]


def drafter_hint(report: Mapping[str, Any] | None, ctx: Context, plan: Plan,
                 mechs: Sequence[Mechanism]) -> list[Candidate]:  # fmt: skip
    """``drafter_choice`` of the drafter the profile's tau factor compared the plan against, when
    that is another drafter this context builds (``tau_drafter`` of an alternative point, see
    :func:`specpilot.costmodel.profile`) and ``drafter_choice`` is among ``mechs``: tried before
    the sampler's guesses (source "profile")."""
    if not report or not any(m.id == "drafter_choice" for m in mechs):
        return []
    name = report.get("tau_drafter")
    points = report.get("tau_drafters") or []
    alt = any(isinstance(d, Mapping) and d.get("drafter") == name and d.get("alternative")
              for d in points)  # fmt: skip
    if not alt or name == plan.drafter or name not in ctx.drafters:
        return []
    return [Candidate("drafter_choice", {"drafter": name}, "profile")]


class BuiltinExplorer:
    """Memory priors, then Optuna, over the mechanisms of each direction in order; a direction
    with nothing (left) to try falls through to the next."""

    level = ""

    def __init__(self, search: Search, mechs: Mapping[str, Mechanism], memory: Memory | None,
                 ctx_of: Callable[[Mapping[str, Any]], Context], apply: Apply) -> None:  # fmt: skip
        self.search, self.mechs, self.memory = search, mechs, memory
        self.ctx_of, self.apply = ctx_of, apply

    def propose(self, ask: RoundAsk) -> Proposals:
        p, ctx = Plan.from_json(ask.plan), self.ctx_of(ask.plan)
        chosen: list[str] = []
        items: list[Item] = []
        for f in ask.order:
            want = ask.want - len(items)
            if want <= 0 or (len(chosen) >= ask.n_directions and (items or ask.have)):
                break
            mechs = [m for m in self.mechs.values()
                     if m.factor == f and m.applicable(ctx, p) is None]  # fmt: skip
            share = max(1, want // 2) if len(chosen) + 1 < ask.n_directions else want
            got = [c for c in drafter_hint(ask.report, ctx, p, mechs) if c.key not in ask.tried]
            ask.tried.update(c.key for c in got)
            if mechs and share > len(got):
                got += propose_useful(self.search, mechs, ctx, p, self.memory, share - len(got),
                                      ask.tried, self.apply)  # fmt: skip
            if not got:
                continue
            chosen.append(f)
            for c in got:
                ask.tried.add(c.key)
                items.append(Item(c.mechanism, c.params, c.source, f))
        return Proposals(items, chosen)

    def child_extras(self, plan: Mapping[str, Any], steps: Sequence[tuple[str, Any]]
                     ) -> ChildExtras:  # fmt: skip
        return (), (), ""

    def after_round(self, rnd: int, items: Sequence[Item], results: Mapping[str, TrialResult],
                    kept: Sequence[Change]) -> list[dict[str, Any]]:  # fmt: skip
        return []

    def learn(self, rec: TrialRecord) -> None:
        """Tell the sampler an explore trial's outcome (failures score 0)."""
        if rec.kind != "explore" or not rec.steps or rec.interrupted:
            return
        mid, params = rec.steps[-1]
        mech = self.mechs.get(mid)
        if mech is None:
            return
        res = rec.result
        value = res.speedup if res.status == PASS and res.speedup else 0.0
        self.search.tell(Candidate(mid, params), mech.space(self.ctx_of(rec.base_plan),
                                                            Plan.from_json(rec.base_plan)), value)
