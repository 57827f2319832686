"""``specpilot optimize`` as a user stops it: the first Ctrl-C (SIGINT) ends the run cleanly with
the trial in flight recorded as INTERRUPTED (not CRASH), and ``--resume`` runs that trial again;
a progress line per trial shows while the run goes; a run whose budget pays for no round says
why; a bad ``--mechanisms`` module is one clean error line and leaves no run directory."""

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

from .pilot_helpers import MAX_NEW, REPO, tiny_model_dir

SETTINGS = {
    "timed_rounds": 2, "timed_per_round": 1, "forcing_prompts": 2, "profile_prompts": 1,
    "stop_on_eos": False,
    "profile_config": {"max_new_tokens": 8, "max_budget": 4, "replay_depth": 4,
                       "verify_repeats": 1, "draft_samples": 2},
    "limits": {"threads": 1, "request_timeout_s": 30},
}  # fmt: skip


def _records(journal: Path, kind: str) -> list[dict]:
    out = []
    for line in journal.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("type") == kind:
            out.append(rec)
    return out


def _prompts(path: Path) -> Path:
    words = ["alpha", "beta", "gamma", "delta", "sigma", "omega", "kappa", "theta"]
    with open(path, "w") as f:
        for i in range(7):
            text = " ".join(words[(i + j) % 8] for j in range(12))
            f.write(json.dumps({"id": f"q{i}", "prompt": f"{text} {i}"}) + "\n")
    return path


def _args(model: Path, prompts: Path, out: Path, mem: Path, *extra: str) -> list[str]:
    return [
        "--model", str(model), "--prompts", str(prompts), "--max-new-tokens", str(MAX_NEW),
        "--out", str(out), "--memory", str(mem), "--candidates", "1", "--max-rounds", "1",
        "--python-path", REPO, "--no-registry", "--memory-limit-gb", "4",
        *(a for k, v in SETTINGS.items() for a in ("--set", f"{k}={json.dumps(v)}")), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("interrupt") / "model")


def test_first_sigint_records_the_trial_in_flight_and_resume_reruns_it(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture
) -> None:
    out, mem = tmp_path / "run", tmp_path / "memory.sqlite"
    cmd = [sys.executable, "-m", "specpilot.cli_optimize",
           *_args(model, _prompts(tmp_path / "p.jsonl"), out, mem, "--mechanisms",
                  "tests.pilot_slow_mechs", "--budget-minutes", "8")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}  # one torch thread
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 240
    trials = out / "trials"
    while time.monotonic() < deadline and proc.poll() is None:  # the explore trial is running
        if trials.is_dir() and any("_explore_" in p.name for p in trials.iterdir()):
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read()[-2000:] if proc.stderr else ""
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    (rec,) = _records(out / "journal.jsonl", "trial")
    assert rec["result"]["status"] == "INTERRUPTED" and rec["kind"] == "explore"
    assert "--resume runs it again" in rec["result"]["reason"]
    assert not _records(out / "journal.jsonl", "round_end")  # the round stays open
    assert "stopping" in err and "INTERRUPTED" in err  # the stop and the trial's progress line
    assert f"--resume {out}" in err

    # the resume through the same entry point in this process (no second torch start-up)
    rc = main(["optimize", "--resume", str(out), "--memory", str(mem), "--budget-minutes", "8"])
    again = capsys.readouterr().err
    assert rc == 0, again[-3000:]
    recs = _records(out / "journal.jsonl", "trial")
    assert recs[0] == rec and recs[1]["key"] == rec["key"]  # the same trial, run again
    assert recs[1]["result"]["status"] == "PASS"
    assert "round 0 explore sluggish" in again  # a progress line per trial
    assert len(_records(out / "journal.jsonl", "round_end")) == 1


def test_a_budget_that_pays_for_no_round_says_why(tmp_path: Path, model: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "run"
    args = _args(model, _prompts(tmp_path / "p.jsonl"), out, tmp_path / "m.sqlite",
                 "--mechanisms", "tests.pilot_loop_mechs", "--budget-minutes", "0.5")  # fmt: skip
    assert main(["optimize", *args]) == 0
    err = capsys.readouterr().err
    assert "0 round(s), 0 trial(s)" in err
    # normally "the budget has N s left, round 0's profile needs about 60 s"; on a machine so
    # busy that loading took the whole half minute, "the budget (0.5 min) is spent before ..."
    assert "stopped: the budget" in err and "(raise --budget-minutes)" in err


@pytest.mark.parametrize(
    ("module", "why"),
    [("tests.no_such_module", "cannot import module 'tests.no_such_module'"),
     ("tests.pilot_helpers", "has no MECHANISMS")],
)  # fmt: skip
def test_a_bad_mechanisms_module_is_one_clean_line_and_no_run_dir(
    tmp_path: Path, model: Path, capsys: pytest.CaptureFixture, module: str, why: str
) -> None:
    out = tmp_path / "run"
    args = _args(model, _prompts(tmp_path / "p.jsonl"), out, tmp_path / "m.sqlite",
                 "--mechanisms", module)  # fmt: skip
    assert main(["optimize", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specpilot: error: --mechanisms") and why in err
    assert len(err.splitlines()) == 1 and "─" not in err and "│" not in err
    assert not out.exists()
