"""The run directory's journal: every decision and every finished trial, durably, in order.

``DIR/journal.jsonl`` is append-only; each record is one JSON line, flushed and fsynced before
the coordinator takes its next step, so ``kill -9`` can lose at most a trial still in flight
(which a resume runs again). Records (``type``):
  run        - the configuration, the run id and the start plan (first record);
  profile    - a round's Phase 0 result (factors, direction(s), the report's summary);
  candidates - a round's Phase 1 candidates, decided before any is dispatched;
  trial      - one finished trial (explore or integrate) with its idempotency key and result;
  round_end  - the plan after Phase 2, winners and kept changes.
Every record carries ``elapsed``: run seconds so far, summed over sessions (the budget counts
them all). A torn last line (a kill in the middle of a write) is ignored on replay
(ShinkaEvolve #98: resume must not miscount).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpilot.errors import ConfigError

JOURNAL = "journal.jsonl"


class Journal:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / JOURNAL

    def exists(self) -> bool:
        return self.path.exists() and self.path.stat().st_size > 0

    def append(self, rec: dict[str, Any]) -> None:
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

    profile: dict[str, Any] | None = None
    candidates: dict[str, Any] | None = None
    trials: dict[str, dict[str, Any]] = field(default_factory=dict)
    """idempotency key -> result JSON."""


@dataclass
class RunState:
    run: dict[str, Any]
    plan: dict[str, Any]
    """The current plan (the last round_end's, else the start plan)."""
    round: int
    """The round to run next (or to finish)."""
    elapsed: float
    current: RoundState
    rounds: list[dict[str, Any]]
    """round_end records so far."""
    profiles: list[dict[str, Any]]
    trials: list[dict[str, Any]]
    """Every trial record so far (for the search's history and the report)."""


def replay(journal: Journal) -> RunState:
    """Rebuild the run's state from its journal."""
    recs = list(journal.records())
    if not recs or recs[0]["type"] != "run":
        raise ConfigError(f"--resume: {journal.path} has no run record; not a specpilot run")
    run = recs[0]
    plan = run["start_plan"]
    rnd, elapsed = 0, 0.0
    cur = RoundState()
    rounds, profiles, trials = [], [], []
    for rec in recs:
        elapsed = max(elapsed, float(rec.get("elapsed", 0.0)))
        t = rec["type"]
        if t == "profile":
            profiles.append(rec)
            if rec["round"] == rnd:
                cur.profile = rec
        elif t == "candidates" and rec["round"] == rnd:
            cur.candidates = rec
        elif t == "trial":
            if rec["key"] not in {x["key"] for x in trials}:
                trials.append(rec)
            if rec["round"] == rnd:
                cur.trials[rec["key"]] = rec["result"]
        elif t == "round_end":
            rounds.append(rec)
            plan = rec["plan"]
            rnd = rec["round"] + 1
            cur = RoundState()
    return RunState(run, plan, rnd, elapsed, cur, rounds, profiles, trials)
