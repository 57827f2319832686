"""Typed records of a run: what the journal, the round log and the report hold.

Each record is a dataclass with ``to_json`` / ``from_json``; the JSON is the on-disk format of
``journal.jsonl`` and ``rounds.jsonl`` (unchanged from the dict records earlier versions wrote,
so old run directories still resume). Plans stay plan JSON (``PlanJSON``): the plan hash and
the memory key are computed from it.

  * :class:`Item`          - one Phase 1 candidate of a round (mechanism, params, its key);
  * :class:`Change`        - a winner of Phase 1 or a change kept by Phase 2 / recall;
  * :class:`Outcome`       - a candidate with the brief of its trial's result (the round log);
  * :class:`Flag`          - a speedup above the cost model's ceiling and its re-measurement;
  * :class:`RunRecord`, :class:`ProfileRecord`, :class:`CandidatesRecord`,
    :class:`TrialRecord`, :class:`RoundSummary` - the journal's record types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specpilot.pilot.trial import INTERRUPTED, TrialResult

PlanJSON = dict[str, Any]
"""A plan as :meth:`specpilot.plan.Plan.to_json` writes it."""
Steps = list[list[Any]]
"""Mechanism steps as journaled: ``[[mechanism_id, params], ...]``."""


def _some(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` without the optional entries that are None."""
    return {k: v for k, v in d.items() if v is not None}


@dataclass(frozen=True)
class Item:
    """One candidate of a round: apply ``mechanism`` with ``params`` to the round's plan."""

    mechanism: str
    params: dict[str, Any]
    source: str
    """"memory", "optuna", "default", "agent" (Phase 1) or "memory" (a recalled stack)."""
    direction: str
    key: str = ""
    """The trial's idempotency key (:func:`specpilot.pilot.config.trial_key`)."""
    agent: int | None = None
    """The agent that proposed it (agent candidates only)."""

    @property
    def steps(self) -> Steps:
        return [[self.mechanism, self.params]]

    def to_json(self) -> dict[str, Any]:
        return _some({"mechanism": self.mechanism, "params": self.params,
                      "source": self.source, "direction": self.direction, "key": self.key,
                      "agent": self.agent})  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Item:
        return cls(d["mechanism"], dict(d.get("params") or {}), d.get("source", ""),
                   d.get("direction", ""), d.get("key", ""), d.get("agent"))  # fmt: skip


@dataclass(frozen=True)
class Change:
    """A measured change: a Phase 1 winner, or a change Phase 2 (or recall) kept."""

    mechanism: str
    params: dict[str, Any]
    speedup: float
    spread: float
    key: str
    source: str | None = None
    direction: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _some({"mechanism": self.mechanism, "params": self.params, "speedup": self.speedup,
                      "spread": self.spread, "key": self.key, "source": self.source,
                      "direction": self.direction})  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Change:
        return cls(d["mechanism"], dict(d.get("params") or {}), float(d["speedup"]),
                   float(d.get("spread") or 0.0), d.get("key", ""), d.get("source"),
                   d.get("direction"))  # fmt: skip


BRIEF = ("status", "reason", "speedup", "spread", "tau")


@dataclass(frozen=True)
class Outcome:
    """A round's candidate and the brief of its result ("NOT RUN" when it never ran)."""

    item: Item
    status: str = "NOT RUN"
    reason: str | None = None
    speedup: float | None = None
    spread: float | None = None
    tau: float | None = None
    ran: bool = False

    @classmethod
    def of(cls, item: Item, res: TrialResult | None) -> Outcome:
        if res is None:
            return cls(item)
        return cls(item, res.status, res.reason, res.speedup, res.spread, res.tau, True)

    def to_json(self) -> dict[str, Any]:
        if not self.ran:
            return {**self.item.to_json(), "status": self.status}
        return {**self.item.to_json(), "status": self.status, "reason": self.reason,
                "speedup": self.speedup, "spread": self.spread, "tau": self.tau}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Outcome:
        ran = "reason" in d or d.get("status") != "NOT RUN"
        return cls(Item.from_json(d), d.get("status", "NOT RUN"), d.get("reason"),
                   d.get("speedup"), d.get("spread"), d.get("tau"), ran)  # fmt: skip


@dataclass(frozen=True)
class Flag:
    """A speedup above the cost model's ceiling for the candidate's plan (see
    :mod:`specpilot.pilot.honesty`): flagged, re-measured, and kept only if the re-measurement
    is within the ceiling (and passes the usual keep rule)."""

    key: str
    mechanism: str
    speedup: float
    ceiling: float
    remeasure_key: str = ""
    remeasured: float | None = None
    """The re-measured speedup (None: not re-measured, e.g. out of budget or not PASS)."""
    cleared: bool = False
    """The re-measurement is within the ceiling."""

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "mechanism": self.mechanism, "speedup": self.speedup,
                "ceiling": self.ceiling, "remeasure_key": self.remeasure_key,
                "remeasured": self.remeasured, "cleared": self.cleared}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Flag:
        return cls(d["key"], d["mechanism"], float(d["speedup"]), float(d["ceiling"]),
                   d.get("remeasure_key", ""), d.get("remeasured"), bool(d.get("cleared")))


@dataclass
class RunRecord:
    """The first record: the configuration, the run id and the start plan."""

    run_id: str
    config: dict[str, Any]
    start_plan: PlanJSON
    elapsed: float = 0.0
    type: str = "run"

    def to_json(self) -> dict[str, Any]:
        return {"type": "run", "run_id": self.run_id, "config": self.config,
                "start_plan": self.start_plan, "elapsed": self.elapsed}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunRecord:
        return cls(d["run_id"], dict(d["config"]), dict(d["start_plan"]), d.get("elapsed", 0.0))


@dataclass
class ProfileRecord:
    """A round's Phase 0: the cost model's factors and report summary (or why it failed)."""

    round: int
    status: str
    reason: str
    seconds: float
    factors: dict[str, float] | None = None
    report: dict[str, Any] | None = None
    elapsed: float = 0.0
    type: str = "profile"

    @property
    def interrupted(self) -> bool:
        return self.status == INTERRUPTED

    def to_json(self) -> dict[str, Any]:
        d = {"type": "profile", "round": self.round, "status": self.status,
             "reason": self.reason, "seconds": self.seconds, "elapsed": self.elapsed}  # fmt: skip
        if self.factors is not None:
            d.update(factors=self.factors, report=self.report)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ProfileRecord:
        return cls(d["round"], d["status"], d.get("reason", ""), d.get("seconds", 0.0),
                   d.get("factors"), d.get("report"), d.get("elapsed", 0.0))  # fmt: skip


@dataclass
class CandidatesRecord:
    """A round's Phase 1 candidates, decided before any is dispatched."""

    round: int
    directions: list[str]
    items: list[Item]
    agent: list[dict[str, Any]] | None = None
    """The extra explorer's log (agents' requests and their outcomes); None without one."""
    elapsed: float = 0.0
    type: str = "candidates"

    def to_json(self) -> dict[str, Any]:
        d = {"type": "candidates", "round": self.round, "directions": self.directions,
             "items": [it.to_json() for it in self.items], "elapsed": self.elapsed}  # fmt: skip
        if self.agent is not None:
            d["agent"] = self.agent
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CandidatesRecord:
        return cls(d["round"], list(d.get("directions", [])),
                   [Item.from_json(it) for it in d.get("items", [])], d.get("agent"),
                   d.get("elapsed", 0.0))  # fmt: skip


@dataclass
class TrialRecord:
    """One finished (or interrupted) trial with its idempotency key and result."""

    round: int
    kind: str
    """explore, integrate, recall or remeasure."""
    key: str
    base: str
    """The base plan's hash."""
    base_plan: PlanJSON
    steps: Steps
    result: TrialResult
    elapsed: float = 0.0
    type: str = "trial"

    @property
    def interrupted(self) -> bool:
        return self.result.status == INTERRUPTED

    def to_json(self) -> dict[str, Any]:
        return {"type": "trial", "round": self.round, "kind": self.kind, "key": self.key,
                "base": self.base, "base_plan": self.base_plan, "steps": self.steps,
                "result": self.result.to_json(), "elapsed": self.elapsed}  # fmt: skip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TrialRecord:
        return cls(d["round"], d["kind"], d["key"], d.get("base", ""),
                   dict(d.get("base_plan") or {}), [list(s) for s in d.get("steps", [])],
                   TrialResult.from_json(d["result"]), d.get("elapsed", 0.0))  # fmt: skip


@dataclass
class RoundSummary:
    """The end of a round: the plan after Phase 2, its winners, kept changes and candidates."""

    round: int
    base: str
    plan: PlanJSON
    factors: dict[str, float]
    directions: list[str]
    winners: list[Change]
    kept: list[Change]
    candidates: list[Outcome]
    agent: list[dict[str, Any]] | None = None
    sandbox: str | None = None
    flags: list[Flag] = field(default_factory=list)
    elapsed: float = 0.0
    type: str = "round_end"

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "type": "round_end", "round": self.round, "base": self.base, "plan": self.plan,
            "factors": self.factors, "directions": self.directions,
            "winners": [w.to_json() for w in self.winners],
            "kept": [k.to_json() for k in self.kept],
            "candidates": [c.to_json() for c in self.candidates], "elapsed": self.elapsed,
        }  # fmt: skip
        if self.agent is not None:
            d.update(agent=self.agent, sandbox=self.sandbox)
        if self.flags:
            d["flags"] = [f.to_json() for f in self.flags]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RoundSummary:
        return cls(
            d["round"], d.get("base", ""), dict(d["plan"]), dict(d.get("factors") or {}),
            list(d.get("directions", [])), [Change.from_json(w) for w in d.get("winners", [])],
            [Change.from_json(k) for k in d.get("kept", [])],
            [Outcome.from_json(c) for c in d.get("candidates", [])], d.get("agent"),
            d.get("sandbox"), [Flag.from_json(f) for f in d.get("flags", [])],
            d.get("elapsed", 0.0),
        )  # fmt: skip
