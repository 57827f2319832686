"""Recording: the journal, the run state, the memory and the outputs (``plan.json``,
``rounds.jsonl``, ``report.html``).

:class:`Recorder` is the only writer of the run directory and the memory. Every finished trial is
journaled (fsynced) first, then written to the memory (idempotent by key), then added to the run
state, before the loop takes its next step. An INTERRUPTED trial is journaled only: it says
nothing about its candidate, and a resume runs it again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specpilot.mechanisms.base import FACTORS, Context
from specpilot.pilot.config import plan_hash
from specpilot.pilot.events import EventFn, RunSummary
from specpilot.pilot.journal import Journal, RoundState, RunState
from specpilot.pilot.memory import Memory
from specpilot.pilot.records import (
    CandidatesRecord,
    PlanJSON,
    ProfileRecord,
    RoundSummary,
    Steps,
    TrialRecord,
)
from specpilot.pilot.report import describe_plan, write_report
from specpilot.pilot.running import Clock
from specpilot.pilot.trial import TrialResult
from specpilot.plan import Plan, save_plan

FULL_POOL = ("integrate", "recall", "remeasure")
"""Trial kinds forced on the whole held-back pool."""


class Recorder:
    def __init__(self, out: Path, journal: Journal, state: RunState, memory: Memory, clock: Clock,
                 emit: EventFn, ctx_of: Callable[[Mapping[str, Any]], Context],
                 learn: Callable[[TrialRecord], None]) -> None:  # fmt: skip
        self.out, self.journal, self.state, self.memory = out, journal, state, memory
        self.clock, self.emit, self.ctx_of, self.learn = clock, emit, ctx_of, learn

    @property
    def run_id(self) -> str:
        return self.state.run.run_id

    def log(self, rec: Any) -> None:
        """Journal a typed record (its ``elapsed`` set now)."""
        rec.elapsed = round(self.clock.elapsed(), 3)
        self.journal.append(rec.to_json())

    def log_raw(self, rec: dict[str, Any]) -> None:
        """Journal an extra explorer's own record."""
        self.journal.append({**rec, "elapsed": round(self.clock.elapsed(), 3)})

    def trial(self, rnd: int, kind: str, key: str, base: PlanJSON, steps: Steps,
              res: TrialResult) -> TrialResult:  # fmt: skip
        rec = TrialRecord(rnd, kind, key, plan_hash(base), dict(base), steps, res)
        self.log(rec)  # durable first, then memory (idempotent by key), then the sampler
        if not rec.interrupted:
            self.state.trials.append(rec)
            self.state.current.trials[key] = res
            self.remember(rec)
        self.emit("trial_done", rec)
        return res

    def remember(self, rec: TrialRecord) -> None:
        pool = "full" if rec.kind in FULL_POOL else "sample"
        steps = [(m, p) for m, p in rec.steps]
        ctx = self.ctx_of(rec.base_plan)
        self.memory.record_trial(rec.key, self.run_id, rec.round, rec.kind, ctx, steps,
                                 rec.result.to_json(), pool)  # fmt: skip
        self.learn(rec)

    def profile(self, rec: ProfileRecord) -> None:
        if rec.factors is not None:
            self._factor_deltas(rec.factors)
        self.log(rec)
        if not rec.interrupted:
            self.state.profiles.append(rec)
            self.state.current.profile = rec
        self.emit("profile", rec)

    def _factor_deltas(self, factors: Mapping[str, float]) -> None:
        """Attribute the factor change since the last profile to the changes kept in between."""
        prev = [p for p in self.state.profiles if p.factors]
        if not prev or not self.state.rounds:
            return
        before = prev[-1].factors or {}
        deltas = {f: factors[f] - before[f] for f in FACTORS}
        for k in self.state.rounds[-1].kept:
            self.memory.set_factor_deltas(k.key, deltas)

    def candidates(self, rec: CandidatesRecord) -> None:
        self.log(rec)
        self.state.current.candidates = rec

    def end_round(self, summary: RoundSummary) -> None:
        """Log a round_end record and move the run to the next round on its plan."""
        st = self.state
        self.log(summary)
        st.rounds.append(summary)
        st.plan = summary.plan
        st.round = summary.round + 1
        st.current = RoundState()
        self.save_outputs()
        self.emit("round_end", summary)

    def save_outputs(self) -> None:
        """plan.json, rounds.jsonl and report.html, each rewritten whole from the state."""
        st = self.state
        save_plan(Plan.from_json(st.plan), self.out / "plan.json")
        lines = "".join(
            json.dumps({k: v for k, v in r.to_json().items() if k != "type"}) + "\n"
            for r in st.rounds
        )
        tmp = self.out / ".rounds.jsonl.tmp"
        tmp.write_text(lines)
        tmp.replace(self.out / "rounds.jsonl")
        write_report(self.out / "report.html", st.run, st.profiles, st.rounds, st.trials, st.plan)

    def finish(self, stop_reason: str, interrupted: bool, sandbox: str | None) -> RunSummary:
        st = self.state
        self.save_outputs()
        counts: dict[str, int] = {}
        for t in st.trials:
            counts[t.result.status] = counts.get(t.result.status, 0) + 1
        kept = [k for r in st.rounds for k in r.kept]
        gain = 1.0
        for k in kept:
            gain *= k.speedup
        summary = RunSummary(
            self.run_id, str(self.out), len(st.rounds), len(st.trials), counts,
            self.clock.elapsed(), describe_plan(st.run.start_plan), describe_plan(st.plan), gain,
            kept, stop_reason, interrupted, sandbox,
        )  # fmt: skip
        self.emit("done", summary)
        return summary


def forget_flagged(memory: Memory, rounds: Sequence[RoundSummary]) -> None:
    """Drop the memory effects of results above the ceiling that were not cleared (a resumed
    run's replay may have written them again)."""
    for r in rounds:
        for f in r.flags:
            memory.forget_effect(f.key)
            if f.remeasure_key and not f.cleared:
                memory.forget_effect(f.remeasure_key)
