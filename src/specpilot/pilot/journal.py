"""The run directory's journal: every decision and every finished trial, durably, in order.

``DIR/journal.jsonl`` is append-only; each record is one JSON line, flushed and fsynced before
the coordinator takes its next step, so ``kill -9`` can lose at most a trial still in flight
(which a resume runs again). Records (``type``):
  run        - the configuration, the run id and the start plan (first record);
  profile    - a round's Phase 0 result (factors, direction(s), the report's summary);
  candidates - a round's Phase 1 candidates, decided before any is dispatched;
  trial      - one finished trial (explore, integrate, recall, remeasure) with its idempotency
               key and result; status INTERRUPTED when the run was stopped (SIGINT) with it in
               flight: replay ignores it, so a resume runs it again;
  round_end  - the plan after Phase 2, winners, kept changes and ceiling flags.
The records are the typed ones of :mod:`.records`; an extra explorer may add its own types.
Every record carries ``elapsed``: run seconds so far, summed over sessions (the budget counts
them all). A torn last line (a kill in the middle of a write) is ignored on replay
(ShinkaEvolve #98: resume must not miscount).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpilot.errors import ConfigError
from specpilot.pilot.records import (
    CandidatesRecord,
    PlanJSON,
    ProfileRecord,
    RoundSummary,
    RunRecord,
    TrialRecord,
)
from specpilot.pilot.trial import TrialResult

JOURNAL = "journal.jsonl"


class Journal:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / JOURNAL

    def exists(self) -> bool:
        return self.path.exists() and self.path.stat().st_size > 0

    def append(self, rec: Mapping[str, Any]) -> None:
        line = json.dumps(rec, separators=(",", ":"), sort_keys=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with open(self.path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # torn last line
                if isinstance(rec, dict) and "type" in rec:
                    yield rec


@dataclass
class RoundState:
    """What a round has already done (from the journal)."""

    profile: ProfileRecord | None = None
    candidates: CandidatesRecord | None = None
    trials: dict[str, TrialResult] = field(default_factory=dict)
    """idempotency key -> result."""


@dataclass
class RunState:
    run: RunRecord
    plan: PlanJSON
    """The current plan (the last round_end's, else the start plan)."""
    round: int
    """The round to run next (or to finish)."""
    elapsed: float
    current: RoundState
    rounds: list[RoundSummary]
    """round_end records so far."""
    profiles: list[ProfileRecord]
    trials: list[TrialRecord]
    """Every finished trial so far (for the search's history and the report)."""


def replay(journal: Journal) -> RunState:
    """Rebuild the run's state from its journal. INTERRUPTED trials and profiles count as not
    run (a resume runs them again); they stay in the journal as history."""
    recs = list(journal.records())
    if not recs or recs[0]["type"] != "run":
        raise ConfigError(f"--resume: {journal.path} has no run record; not a specpilot run")
    run = RunRecord.from_json(recs[0])
    plan, rnd, elapsed = run.start_plan, 0, 0.0
    cur = RoundState()
    rounds: list[RoundSummary] = []
    profiles: list[ProfileRecord] = []
    trials: dict[str, TrialRecord] = {}
    for rec in recs:
        elapsed = max(elapsed, float(rec.get("elapsed", 0.0)))
        t = rec["type"]
        if t == "profile":
            prof = ProfileRecord.from_json(rec)
            if prof.interrupted:
                continue
            profiles.append(prof)
            if prof.round == rnd:
                cur.profile = prof
        elif t == "candidates" and rec["round"] == rnd:
            cur.candidates = CandidatesRecord.from_json(rec)
        elif t == "trial":
            tr = TrialRecord.from_json(rec)
            if tr.interrupted:
                continue
            trials.setdefault(tr.key, tr)
            if tr.round == rnd:
                cur.trials[tr.key] = tr.result
        elif t == "round_end":
            summary = RoundSummary.from_json(rec)
            rounds.append(summary)
            plan, rnd = summary.plan, summary.round + 1
            cur = RoundState()
    return RunState(run, plan, rnd, elapsed, cur, rounds, profiles, list(trials.values()))
