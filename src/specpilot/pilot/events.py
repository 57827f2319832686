"""What a run tells its caller while it goes: ``on_event(kind, payload)`` (the CLI renders;
library code never prints). Kinds and payloads:

  start          :class:`Start`
  reference      :class:`ReferenceProgress` (a trusted reference output being decoded)
  profile_start  the round (int)
  profile        :class:`~.records.ProfileRecord`
  round          :class:`RoundStart`
  trial_start    :class:`TrialStart`
  trial_done     :class:`~.records.TrialRecord`
  flag           :class:`~.records.Flag` (a speedup above the cost model's ceiling)
  stopping       the reason (str): the first SIGINT was seen; trials in flight end INTERRUPTED
  round_end      :class:`~.records.RoundSummary`
  done           :class:`RunSummary`
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specpilot.pilot.records import Change, Item, PlanJSON

EventFn = Callable[[str, Any], None]


def ignore(kind: str, payload: Any) -> None:
    """The default ``on_event``."""


@dataclass(frozen=True)
class Start:
    run_id: str
    resumed: bool
    elapsed: float
    budget_s: float
    plan: PlanJSON


@dataclass(frozen=True)
class ReferenceProgress:
    done: int
    total: int
    prompt: str


@dataclass(frozen=True)
class RoundStart:
    round: int
    factors: dict[str, float]
    directions: list[str]
    candidates: list[Item]
    agent: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class TrialStart:
    round: int
    kind: str
    item: Item


@dataclass(frozen=True)
class RunSummary:
    """How a run ended (also after a stop): what the CLI prints."""

    run_id: str
    out: str
    rounds: int
    trials: int
    statuses: dict[str, int]
    elapsed_s: float
    start_plan: str
    final_plan: str
    loop_speedup: float
    kept: list[Change]
    stop_reason: str
    """Why the loop ended (budget, rounds, nothing left to try, interrupted, ...)."""
    interrupted: bool = False
    sandbox: str | None = None
