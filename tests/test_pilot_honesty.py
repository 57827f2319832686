"""The loop's honesty: a speedup above the cost model's ceiling (tokens per step over the floor of
a step) is flagged in the round log and re-measured before it can be kept.

The ceiling arithmetic is checked on its own; the loop is checked in process with a scripted
executor (planted profile with known floors, planted trial results for the planted
``impossible`` mechanism), so the numbers are exact and nothing is timed."""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from specpilot.mechanisms.base import FACTORS
from specpilot.pilot.config import OptimizeConfig
from specpilot.pilot.coordinator import Coordinator
from specpilot.pilot.honesty import above, ceiling, max_tokens_per_step, step_floor_ms
from specpilot.pilot.memory import Memory
from specpilot.pilot.steps import all_mechanisms, apply_steps
from specpilot.pilot.trial import PASS, ProfileJob, TrialJob, TrialLimits, TrialResult
from specpilot.plan import Plan
from specpilot.tree import TreeSpec

from .pilot_helpers import MAX_NEW, prompts, tiny_model_dir

FLOOR_MS = 1.0
BASE_TOK_S = 1000.0
"""Chain of 5 -> at most 6 tokens per step; 6 / 1 ms = 6000 tok/s = 6x a 1000 tok/s baseline."""
REPORT = {"kernels": [{"name": "matmul", "flops": 1.0, "bytes": 1.0, "floor_ms": 0.75,
                       "measured_ms": 2.0},
                      {"name": "lm_head", "flops": 1.0, "bytes": 1.0, "floor_ms": 0.25,
                       "measured_ms": 1.0}]}  # fmt: skip


def test_ceiling_is_tokens_per_step_over_the_step_floor() -> None:
    chain = Plan(tree=TreeSpec(kind="chain", k=5))
    assert max_tokens_per_step(chain) == 6
    assert max_tokens_per_step(Plan(drafter="none")) == 1
    assert max_tokens_per_step(Plan(tree=TreeSpec(kind="dynamic", budget=3, depth=8))) == 4
    assert step_floor_ms(REPORT) == pytest.approx(FLOOR_MS)
    assert ceiling(REPORT, chain, chain, BASE_TOK_S) == pytest.approx(6.0)
    assert above(6.5, 6.0) and not above(5.9, 6.0) and not above(6.5, None)
    # nothing claimed without floors, without a baseline, or on another dtype
    assert ceiling({"kernels": []}, chain, chain, BASE_TOK_S) is None
    assert ceiling(REPORT, chain, chain, None) is None
    gpu = SimpleNamespace(engine=SimpleNamespace(device="cuda", dtype="bfloat16"),
                          drafter=chain.drafter, tree=chain.tree)  # no GPU here: a stand-in
    assert ceiling(REPORT, chain, gpu, BASE_TOK_S) is None  # type: ignore[arg-type]


class ScriptedExecutor:
    """Profiles report :data:`REPORT`; a trial's speedup comes from ``speedups[kind]`` (the
    kind is read from the trial key: explore, integrate, remeasure)."""

    workers = 1

    def __init__(self, model: Path, speedups: dict[str, float]) -> None:
        from specpilot.loading import load_model
        from specpilot.runtime import context_of

        self.loaded = load_model(str(model))
        self.ctx = lambda p: context_of(self.loaded, p, 1)
        self.speedups = speedups
        self.kinds: list[str] = []

    def profile(self, job: ProfileJob) -> tuple[str, str, dict[str, Any] | None]:
        rep: dict[str, Any] = {f"{f}_factor": 1.0 for f in FACTORS}
        rep.update(kernel_factor=2.0, **REPORT)
        return PASS, "", rep

    def submit(self, job: TrialJob) -> Future[TrialResult]:
        kind = job.key.split("/")[2]
        self.kinds.append(kind)
        mechs = all_mechanisms(job.candidate.modules, use_registry=False)
        plan = apply_steps(Plan.from_json(job.candidate.plan), list(job.candidate.steps), mechs,
                           self.ctx)  # fmt: skip
        forcing = {"status": "PASS", "n_prompts": len(job.forcing), "n_tokens": 10,
                   "summary": "ok", "near_ties": 0, "divergences": []}  # fmt: skip
        res = TrialResult(job.key, PASS, phase="done", plan=plan.to_json(), forcing=forcing,
                          speedup=self.speedups[kind], spread=0.01, base_tok_s=BASE_TOK_S,
                          cand_tok_s=BASE_TOK_S * self.speedups[kind], duration_s=1.0)  # fmt: skip
        fut: Future[TrialResult] = Future()
        fut.set_result(res)
        return fut

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("honesty") / "model")


def _run(tmp: Path, model: Path, speedups: dict[str, float]) -> tuple[Any, ScriptedExecutor]:
    cfg = OptimizeConfig(
        out=str(tmp / "run"), model=str(model), memory=str(tmp / "memory.sqlite"),
        prompts=tuple((pid, tuple(ids)) for pid, ids in prompts(9, seed=5)),
        start_plan=Plan(tree=TreeSpec(kind="chain", k=5)).to_json(), max_new_tokens=MAX_NEW,
        stop_on_eos=False, candidates_per_round=1, forcing_prompts=2, timed_rounds=2,
        timed_per_round=1, max_rounds=1, limits=TrialLimits(threads=1),
        modules=("tests.pilot_ceiling_mechs",), registry=False,
    )  # fmt: skip
    ex = ScriptedExecutor(model, speedups)
    return Coordinator(cfg, executor=ex).run(), ex


def _rounds(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]


def test_an_impossible_speedup_is_flagged_remeasured_and_not_kept(tmp_path: Path,
                                                                   model: Path) -> None:
    speed = {"explore": 40.0, "integrate": 40.0, "remeasure": 40.0}
    summary, ex = _run(tmp_path, model, speed)
    assert ex.kinds == ["explore", "integrate", "remeasure"]
    assert summary.kept == [] and summary.rounds == 1
    (rnd,) = _rounds(tmp_path / "run")
    assert rnd["kept"] == [] and [w["mechanism"] for w in rnd["winners"]] == ["impossible"]
    explore, integrate = rnd["flags"]
    assert explore["speedup"] == 40.0 and explore["ceiling"] == pytest.approx(6.0)
    assert explore["remeasured"] is None  # Phase 1: flagged; integration re-measures
    assert integrate["remeasure_key"].split("/")[2] == "remeasure"
    assert integrate["remeasured"] == 40.0 and not integrate["cleared"]
    mem = Memory(tmp_path / "memory.sqlite")
    assert mem.counts()["trials"] == 3 and mem.list_entries() == []  # no effect to recall
    mem.close()
    html = (tmp_path / "run" / "report.html").read_text()
    assert "impossible: 40.000x reported, ceiling 6.000x; re-measured 40.000x" in html


def test_a_flagged_speedup_that_remeasures_plausibly_is_kept(tmp_path: Path,
                                                              model: Path) -> None:
    summary, ex = _run(tmp_path, model, {"explore": 40.0, "integrate": 40.0, "remeasure": 1.5})
    assert ex.kinds == ["explore", "integrate", "remeasure"]
    (kept,) = summary.kept
    assert kept.mechanism == "impossible" and kept.speedup == 1.5  # the re-measured figure
    (rnd,) = _rounds(tmp_path / "run")
    assert rnd["flags"][-1]["cleared"] and rnd["flags"][-1]["remeasured"] == 1.5
    mem = Memory(tmp_path / "memory.sqlite")
    assert [e["speedup"] for e in mem.list_entries()] == [1.5]
    mem.close()


def test_a_speedup_within_the_ceiling_is_not_flagged(tmp_path: Path, model: Path) -> None:
    summary, ex = _run(tmp_path, model, {"explore": 1.4, "integrate": 1.3, "remeasure": 9.0})
    assert ex.kinds == ["explore", "integrate"]
    assert [k.speedup for k in summary.kept] == [1.3]
    assert "flags" not in _rounds(tmp_path / "run")[0]


def test_a_later_run_recalls_the_kept_change_first(tmp_path: Path, model: Path) -> None:
    _run(tmp_path, model, {"explore": 1.4, "integrate": 1.3})
    second = tmp_path / "second"
    second.mkdir()
    (tmp_path / "memory.sqlite").rename(second / "memory.sqlite")
    summary, ex = _run(second, model, {"recall": 1.25, "explore": 1.0})
    assert ex.kinds[0] == "recall"  # before round 0's profile: the remembered winner, stacked
    rnd = _rounds(second / "run")[0]
    assert rnd["directions"] == ["memory"] and rnd["candidates"][0]["source"] == "memory"
    assert [k["mechanism"] for k in rnd["kept"]] == ["memory[impossible]"]
    assert summary.kept[0].speedup == 1.25
