"""Harness plumbing: frames and their limits, the timing slot (timing excludes all other work),
Optuna candidates, the journal's torn-line tolerance, Ray actors end to end (slow), and what a
trial child imports to set up."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specpilot.mechanisms.base import Context, Param
from specpilot.pilot.journal import Journal, replay
from specpilot.pilot.proc import MAX_FRAME, FrameReader, ProtocolError, TimingSlot, write_frame
from specpilot.pilot.search import Search
from specpilot.plan import Plan

from .pilot_helpers import cases, job, prompts, references, tiny_model_dir


def test_frames_round_trip_and_limits() -> None:
    r, w = os.pipe()
    write_frame(w, {"op": "tokens", "tokens": [1, 2, 3]})
    reader = FrameReader(r)
    assert reader.read(time.monotonic() + 1) == {"op": "tokens", "tokens": [1, 2, 3]}
    os.write(w, struct.pack(">I", MAX_FRAME + 1))
    with pytest.raises(ProtocolError, match="limit"):
        reader.read(time.monotonic() + 1)
    os.close(r)
    os.close(w)


def test_timing_slot_excludes_other_work(tmp_path: Path) -> None:
    slot = TimingSlot(tmp_path / "slot")
    events: list[str] = []
    inside = threading.Event()

    def worker() -> None:
        inside.wait()
        with slot.shared():
            events.append("work")

    t = threading.Thread(target=worker)
    with slot.exclusive():
        t.start()
        inside.set()
        time.sleep(0.3)
        events.append("timed done")
    t.join(5)
    assert events == ["timed done", "work"]
    with slot.shared(), slot.shared():  # work shares
        pass


def test_search_memory_defaults_then_optuna() -> None:
    class M:
        id, factor, description = "k", "tau", "chain"

        def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
            return (Param("k", "int", 5, low=1, high=16),)

        def applicable(self, ctx: Context, plan: Plan) -> str | None:
            return None

        def apply(self, plan: Plan, params: dict) -> Plan:
            return plan

    ctx = Context("llama", 1.0, "suffix", "cpu", "float32")
    s = Search(seed=0)
    got = s.propose([M()], ctx, Plan(), None, 4, tried=set())
    assert all(c.source == "optuna" for c in got)
    assert len({c.key for c in got}) == 4 and all(1 <= c.params["k"] <= 16 for c in got)
    for c in got:
        s.tell(c, M().space(ctx, Plan()), 1.0 + c.params["k"] / 100)
    again = s.propose([M()], ctx, Plan(), None, 2, tried={c.key for c in got})
    assert not {c.key for c in again} & {c.key for c in got}


def test_journal_ignores_a_torn_last_line(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.append({"type": "run", "run_id": "x", "config": {}, "start_plan": {"drafter": "suffix"}})
    res = {"key": "x/r0/a", "status": "PASS"}
    j.append({"type": "trial", "round": 0, "kind": "explore", "key": "x/r0/a", "result": res})
    with open(j.path, "a") as f:
        f.write('{"type": "trial", "round": 0, "key": "x/r0/b", "res')
    st = replay(j)
    assert [t.key for t in st.trials] == ["x/r0/a"] and st.round == 0


@pytest.mark.slow
def test_ray_executor_end_to_end(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from specpilot.pilot.executors import RayExecutor

    model = tiny_model_dir(tmp_path / "model")
    ps = prompts(5)
    cs = cases(ps, references(model, ps))
    ex = RayExecutor(workers=2)
    try:
        ok = ex.submit(job("honest", model, (("honest", {}),), cs[:2], (cs[2:3], cs[3:4])))
        bad = ex.submit(job("drop", model, (("drop_token", {}),), cs[:2]))
        crash = ex.submit(job("segv", model, (("segfault", {}),), cs[:2]))
        r_ok, r_bad, r_crash = ok.result(), bad.result(), crash.result()
    finally:
        ex.shutdown()
        ray.shutdown()
    assert r_ok.status == "PASS" and r_ok.speedup is not None, r_ok.reason
    assert r_bad.status == "MISMATCH"
    assert r_crash.status == "CRASH" and "SIGSEGV" in r_crash.reason


def test_directions_and_idempotency_keys() -> None:
    from specpilot.pilot.config import directions, trial_key

    assert directions({"tau": 1.2, "kernel": 3.0, "overhead": 2.9}, 0.05) == [
        "kernel", "overhead", "tau",
    ]  # fmt: skip
    assert directions({}, 0.05) == ["tau", "kernel", "overhead"]
    plan = Plan().to_json()
    a = trial_key("run", 0, "explore", plan, [["chain_length", {"k": 4}]])
    assert a == trial_key("run", 0, "explore", dict(plan), [["chain_length", {"k": 4}]])
    assert a != trial_key("run", 1, "explore", plan, [["chain_length", {"k": 4}]])
    assert a != trial_key("run", 0, "explore", plan, [["chain_length", {"k": 5}]])


def test_optimize_makes_model_paths_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trial processes run in scratch directories: a relative model path must reach them whole."""
    from specpilot.cli_optimize import _model_ref

    (tmp_path / "models" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert _model_ref("models/m") == str(tmp_path / "models" / "m")
    assert _model_ref("smollm2-135m") == "smollm2-135m"  # a known name, not a path


CHILD_START = """
import sys
from specpilot.engine import GenerationConfig
from specpilot.loading import load_model
from specpilot.pilot.decoder import build_decoder
from specpilot.pilot.steps import all_mechanisms
from specpilot.plan import Plan
loaded = load_model(sys.argv[1])
dec = build_decoder(Plan(), loaded, all_mechanisms(()), tuple(loaded.tokenizer.eos_ids))
dec.decode(list(range(3, 20)), GenerationConfig(max_new_tokens=4, stop_on_eos=False))
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_a_trial_child_sets_up_without_importing_dynamo(tmp_path: Path) -> None:
    """What each trial child (and each CLI command) does at start: load, build, decode. Building
    the model skeleton on the meta device must not pull in torch._dynamo (and sympy): seconds
    per process, paid by every trial."""
    model = tiny_model_dir(tmp_path / "model")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", CHILD_START, str(model)], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout
