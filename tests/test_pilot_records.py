"""The typed records keep the on-disk JSON of earlier runs: records as the dict-based coordinator
wrote them load and write back unchanged (so old run directories resume), and replay treats an
INTERRUPTED trial or profile as not run while keeping it in the journal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specpilot.pilot.journal import Journal, replay
from specpilot.pilot.records import (
    CandidatesRecord,
    ProfileRecord,
    RoundSummary,
    RunRecord,
    TrialRecord,
)
from specpilot.pilot.trial import TrialResult

PLAN = {"drafter": "suffix", "mechanisms": [], "options": {}}
RESULT = TrialResult("r/r0/explore/abc", "PASS", phase="done", plan=PLAN, speedup=1.3,
                     spread=0.02, round_ratios=[1.28, 1.3, 1.32], tau=2.1,
                     duration_s=12.5).to_json()  # fmt: skip
ITEM = {"mechanism": "chain_length", "params": {"k": 7}, "source": "optuna",
        "direction": "tau", "key": "r/r0/explore/abc"}  # fmt: skip
AGENT_ITEM = {"mechanism": "agent_x", "params": {}, "source": "agent", "direction": "kernel",
              "agent": 0, "key": "r/r0/explore/def"}  # fmt: skip
OLD = {
    "run": {"type": "run", "run_id": "r", "config": {"out": "x"}, "start_plan": PLAN,
            "elapsed": 0.5},
    "profile": {"type": "profile", "round": 0, "status": "PASS", "reason": "", "seconds": 20.0,
                "factors": {"tau": 1.2, "kernel": 2.0, "overhead": 1.1},
                "report": {"kernels": [], "gap": 2.6}, "elapsed": 21.0},
    "failed_profile": {"type": "profile", "round": 1, "status": "CRASH", "reason": "boom",
                       "seconds": 3.0, "elapsed": 30.0},
    "candidates": {"type": "candidates", "round": 0, "directions": ["kernel", "tau"],
                   "items": [AGENT_ITEM, ITEM], "agent": [{"agent": 0, "stage": "accepted"}],
                   "elapsed": 22.0},
    "trial": {"type": "trial", "round": 0, "kind": "explore", "key": "r/r0/explore/abc",
              "base": "0123456789ab", "base_plan": PLAN, "steps": [["chain_length", {"k": 7}]],
              "result": RESULT, "elapsed": 40.0},
    "round_end": {
        "type": "round_end", "round": 0, "base": "0123456789ab", "plan": PLAN,
        "factors": {"tau": 1.2, "kernel": 2.0, "overhead": 1.1}, "directions": ["kernel"],
        "winners": [{"mechanism": "chain_length", "params": {"k": 7}, "speedup": 1.3,
                     "spread": 0.02, "key": "r/r0/explore/abc"}],
        "kept": [{"mechanism": "chain_length", "params": {"k": 7}, "speedup": 1.25,
                  "spread": 0.01, "key": "r/r0/integrate/123"}],
        "candidates": [{**ITEM, "status": "PASS", "reason": "", "speedup": 1.3, "spread": 0.02,
                        "tau": 2.1}, {**AGENT_ITEM, "status": "NOT RUN"}],
        "agent": [{"agent": 0, "stage": "stored"}], "sandbox": "audit", "elapsed": 90.0,
    },
    "recall_end": {
        "type": "round_end", "round": 0, "base": "0123456789ab", "plan": PLAN, "factors": {},
        "directions": ["memory"],
        "winners": [{"mechanism": "memory[a]", "params": {"steps": [["a", {}]]},
                     "source": "memory", "direction": "memory", "key": "r/r0/recall/9",
                     "speedup": 1.2, "spread": 0.01}],
        "kept": [{"mechanism": "memory[a]", "params": {"steps": [["a", {}]]},
                  "source": "memory", "direction": "memory", "key": "r/r0/recall/9",
                  "speedup": 1.2, "spread": 0.01}],
        "candidates": [{"mechanism": "memory[a]", "params": {"steps": [["a", {}]]},
                        "source": "memory", "direction": "memory", "key": "r/r0/recall/9",
                        "status": "PASS", "reason": "", "speedup": 1.2, "spread": 0.01,
                        "tau": None}],
        "elapsed": 50.0,
    },
}  # fmt: skip
TYPES: dict[str, Any] = {"run": RunRecord, "profile": ProfileRecord,
                         "failed_profile": ProfileRecord, "candidates": CandidatesRecord,
                         "trial": TrialRecord, "round_end": RoundSummary,
                         "recall_end": RoundSummary}  # fmt: skip


@pytest.mark.parametrize("name", sorted(OLD))
def test_old_records_load_and_write_back_unchanged(name: str) -> None:
    rec = TYPES[name].from_json(OLD[name])
    assert rec.to_json() == OLD[name]


def test_replay_reruns_interrupted_work_and_keeps_it_in_the_journal(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.append(OLD["run"])
    stopped = {**OLD["profile"], "status": "INTERRUPTED", "reason": "interrupted", "elapsed": 5.0}
    del stopped["factors"], stopped["report"]
    j.append(stopped)
    st = replay(j)
    assert st.current.profile is None and st.profiles == []  # the profile runs again
    j.append(OLD["profile"])
    j.append(OLD["candidates"])
    cut = TrialResult(RESULT["key"], "INTERRUPTED", "interrupted (SIGINT) in forcing")
    j.append({**OLD["trial"], "result": cut.to_json()})
    st = replay(j)
    assert st.current.profile is not None and st.current.candidates is not None
    assert st.trials == [] and st.current.trials == {}  # the trial runs again
    j.append(OLD["trial"])
    st = replay(j)
    assert [t.result.status for t in st.trials] == ["PASS"]
    assert st.current.trials[RESULT["key"]].speedup == 1.3
    assert sum(r["type"] == "trial" for r in j.records()) == 2  # history kept
    j.append(OLD["round_end"])
    st = replay(j)
    assert st.round == 1 and st.rounds[0].kept[0].speedup == 1.25 and st.elapsed == 90.0
