"""The trusted trial harness against planted mechanisms: output changers are rejected by forcing,
speed fakers gain nothing, crashes / hangs / memory exhaustion are recorded and the pool goes on.

All trials run once, together, through a 3-worker local pool (module fixture), which also shows
that failing trials never break the pool; each test reads its trial's result.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from specpilot.pilot.executors import LocalExecutor
from specpilot.pilot.trial import CRASH, MISMATCH, PASS, TIMEOUT, TrialLimits, TrialResult

from .pilot_helpers import cases, job, prompts, references, tiny_model_dir

FORCING_ONLY = {"drop_token": MISMATCH, "stop_early": MISMATCH, "swap_near_tie": MISMATCH}
TIMED = ("honest", "cache_outputs", "background_work", "patch_clock")
BROKEN = {"segfault": CRASH, "hang": TIMEOUT, "memory_hog": CRASH}


@pytest.fixture(scope="module")
def results(
    tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None
) -> dict[str, TrialResult]:
    root = tmp_path_factory.mktemp("pilot_trial")
    model = tiny_model_dir(root / "model")
    ps = prompts(8)
    cs = cases(ps, references(model, ps))
    forcing, timed = cs[:2], (cs[2:3], cs[3:4], cs[4:5])
    pid_file = root / "grandchild.pid"
    os.environ["PLANTED_PID_FILE"] = str(pid_file)
    limits = TrialLimits(threads=1, memory_bytes=4 << 30, request_timeout_s=6.0)
    slot = str(root / "slot")
    jobs = []
    for mid in [*FORCING_ONLY, *TIMED, *BROKEN]:
        j = job(mid, model, ((mid, {}),), forcing, timed if mid in TIMED else (), limits, str(root))
        jobs.append(dataclasses.replace(j, slot=slot))
    ex = LocalExecutor(workers=3)
    try:
        futs = {j.key: ex.submit(j) for j in jobs}
        out = {k: f.result() for k, f in futs.items()}
    finally:
        ex.shutdown()
        os.environ.pop("PLANTED_PID_FILE", None)
    out["_pid_file"] = pid_file  # type: ignore[assignment]
    return out


@pytest.mark.parametrize("mid", list(FORCING_ONLY))
def test_output_changers_are_rejected(results: dict[str, TrialResult], mid: str) -> None:
    r = results[mid]
    assert r.status == MISMATCH, r.reason
    assert r.phase == "forcing" and r.speedup is None and r.spread is None
    assert "diverge" in r.reason
    assert r.forcing["status"] == MISMATCH


def test_honest_candidate_passes_with_a_paired_ratio(results: dict[str, TrialResult]) -> None:
    r = results["honest"]
    assert r.status == PASS, r.reason
    assert r.forcing["status"] == PASS and r.forcing["n_prompts"] == 2
    assert len(r.round_ratios) == 3 and r.speedup is not None and r.spread is not None
    assert r.plan is not None
    assert r.plan["mechanisms"] == [{"id": "honest", "params": {"delay_ms": 0}}]


@pytest.mark.parametrize("mid", ["cache_outputs", "background_work", "patch_clock"])
def test_speed_fakers_gain_nothing(results: dict[str, TrialResult], mid: str) -> None:
    r = results[mid]
    if mid == "background_work" and r.status == TIMEOUT:
        # its spinning thread can starve its own decoding past the request limit on a busy
        # 2-core machine: no speed figure at all, so no gain either
        assert r.speedup is None
        return
    assert r.status == PASS, r.reason  # lossless, so it is timed ...
    assert r.speedup is not None
    assert r.speedup < 1.0, (r.speedup, r.round_ratios)  # ... and the parent's clock sees no gain


def test_segfault_is_a_crash(results: dict[str, TrialResult]) -> None:
    r = results["segfault"]
    assert r.status == CRASH and "SIGSEGV" in r.reason


def test_memory_exhaustion_is_a_crash(results: dict[str, TrialResult]) -> None:
    r = results["memory_hog"]
    assert r.status == CRASH and "out of memory" in r.reason


def test_hang_is_a_timeout_and_grandchildren_die(results: dict[str, TrialResult]) -> None:
    r = results["hang"]
    assert r.status == TIMEOUT and "within 6 s" in r.reason
    pid = int(Path(results["_pid_file"]).read_text())  # type: ignore[arg-type]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid), "the hung trial's grandchild (own session) survived the timeout"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
