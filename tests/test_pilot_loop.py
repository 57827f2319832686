"""The loop end to end on a tiny model, as a user runs it: the coordinator (a subprocess) is
killed with SIGKILL after its first finished trial, then ``--resume`` finishes the run. No
finished trial runs twice or is counted twice; a crashing candidate is recorded and the run goes
on; the one real improvement is kept; plan.json, rounds.jsonl and report.html are written.
Only the killed run is a subprocess; the refused ``--out``, the resume and the recalling second
run go through the same CLI entry point in this process (no second torch start-up each)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specpilot.cli import main
from specpilot.pilot.memory import Memory
from specpilot.plan import AppliedMechanism, Plan, load_plan, save_plan

from .pilot_helpers import MAX_NEW, REPO, tiny_model_dir

SETTINGS = {
    "timed_rounds": 3,
    "timed_per_round": 2,
    "forcing_prompts": 2,
    "profile_prompts": 1,
    "stop_on_eos": False,
    "profile_config": {"max_new_tokens": 8, "max_budget": 4, "replay_depth": 4,
                       "verify_repeats": 1, "draft_samples": 2},
    "limits": {"threads": 1, "request_timeout_s": 30},
}  # fmt: skip


def _trials(journal: Path) -> list[dict]:
    out = []
    for line in journal.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("type") == "trial":
            out.append(rec)
    return out


def test_kill_then_resume_loses_no_trial(
    tmp_path: Path, capsys: pytest.CaptureFixture, one_torch_thread: None
) -> None:
    model = tiny_model_dir(tmp_path / "model")
    words = ["alpha", "beta", "gamma", "delta", "sigma", "omega", "kappa", "theta"]
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(9):
            text = " ".join(words[(i + j) % 8] for j in range(12))
            f.write(json.dumps({"id": f"q{i}", "prompt": f"{text} {i}"}) + "\n")
    start = Plan(
        options={"slow_kernel": {"fast": False}},
        mechanisms=(AppliedMechanism("slow_kernel", {"fast": False}),),
    )
    save_plan(start, tmp_path / "start.json")
    out, mem = tmp_path / "run", tmp_path / "memory.sqlite"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}  # one torch thread
    first = [
        "--model", str(model), "--prompts", str(tmp_path / "prompts.jsonl"),
        "--start-plan", str(tmp_path / "start.json"), "--max-new-tokens", str(MAX_NEW),
        "--out", str(out), "--memory", str(mem), "--candidates", "2", "--max-rounds", "1",
        "--mechanisms", "tests.pilot_loop_mechs", "--python-path", REPO, "--no-registry",
        "--memory-limit-gb", "4", "--budget-minutes", "8",
        *(a for k, v in SETTINGS.items() for a in ("--set", f"{k}={json.dumps(v)}")),
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "specpilot.cli_optimize", *first]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    journal = out / "journal.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists() and _trials(journal):
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = _trials(journal)
    assert len(before) == 1 and before[0]["kind"] == "explore"
    capsys.readouterr()
    assert main(["optimize", *first]) == 2  # --out never overwrites a run
    assert "already holds a run" in capsys.readouterr().err

    _run_ok(["--resume", str(out), "--memory", str(mem), "--budget-minutes", "8"], capsys)

    after = _trials(journal)
    keys = [t["key"] for t in after]
    assert len(keys) == len(set(keys)), "a finished trial was run again"
    assert after[0] == before[0]
    by_mech = {(t["kind"], t["steps"][-1][0]): t["result"] for t in after}
    assert by_mech[("explore", "crash_kernel")]["status"] == "CRASH"
    assert "SIGSEGV" in by_mech[("explore", "crash_kernel")]["reason"]
    assert by_mech[("explore", "slow_kernel")]["status"] == "PASS"
    integrate = by_mech[("integrate", "slow_kernel")]
    assert integrate["status"] == "PASS" and integrate["forcing"]["n_prompts"] == 3  # whole pool
    rounds = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert len(rounds) == 1 and [k["mechanism"] for k in rounds[0]["kept"]] == ["slow_kernel"]
    assert rounds[0]["directions"] == ["kernel"] and rounds[0]["factors"]["kernel"] > 1
    # the loop's profile replayed the context's other drafter beside the plan's (suffix)
    profiles = [json.loads(x) for x in journal.read_text().splitlines() if '"profile"' in x]
    rep = next(r["report"] for r in profiles if r.get("type") == "profile" and r.get("report"))
    assert [(d["drafter"], d["alternative"]) for d in rep["tau_drafters"]][1:] == [
        ("lookup", True)
    ] and rep["tau_drafter"] in ("suffix", "lookup")
    plan = load_plan(out)
    assert plan.options["slow_kernel"] == {"fast": True}
    html = (out / "report.html").read_text()
    assert html.count("<svg") == 3 and "slow_kernel" in html
    m = Memory(mem)
    assert m.counts()["trials"] == len(after) == 3
    assert len(m.list_entries()) == 2  # two PASS trials with a speedup (explore, integrate)
    m.close()

    # a second run with this memory starts by recalling the winner: one trial, not three
    again = tmp_path / "again"
    _run_ok([*first[: first.index("--out")], "--out", str(again),
             *first[first.index("--out") + 2 :]], capsys)  # fmt: skip
    trials = _trials(again / "journal.jsonl")
    assert [t["kind"] for t in trials] == ["recall"]
    assert trials[0]["steps"] == [["slow_kernel", {"fast": True}]]
    assert trials[0]["result"]["status"] == "PASS"
    assert trials[0]["result"]["forcing"]["n_prompts"] == 3  # the whole held-back pool
    rounds = [json.loads(line) for line in (again / "rounds.jsonl").read_text().splitlines()]
    assert rounds[0]["directions"] == ["memory"] and rounds[0]["kept"]
    assert load_plan(again).options["slow_kernel"] == {"fast": True}
    m = Memory(mem)
    assert len(m.list_entries()) == 3  # the recall trial is one mechanism: its effect counts
    m.close()


def _run_ok(args: list[str], capsys: pytest.CaptureFixture) -> None:
    rc = main(["optimize", *args])
    assert rc == 0, capsys.readouterr().err[-3000:]
