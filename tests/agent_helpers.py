"""Shared setup of the agent loop tests: a tiny model directory, token prompts, a start plan whose
``slow_path`` sleeps 150 ms per request (tests/agent_mechs.py), and a small, fast
:class:`~specpilot.pilot.config.OptimizeConfig`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specpilot.agent.config import AgentConfig
from specpilot.pilot.config import OptimizeConfig
from specpilot.pilot.trial import TrialLimits
from specpilot.plan import AppliedMechanism, Plan

from .pilot_helpers import MAX_NEW, REPO, prompts

KEY_VAR = "SPECPILOT_TEST_AGENT_KEY"
KEY = "sk-test-a1b2c3d4e5f6-secret"
PROFILE = {"max_new_tokens": 8, "max_budget": 4, "replay_depth": 4, "verify_repeats": 1,
           "draft_samples": 2}  # fmt: skip


def start_plan() -> dict[str, Any]:
    return Plan(
        options={"slow_path": {"fast": False}},
        mechanisms=(AppliedMechanism("slow_path", {"fast": False}),),
    ).to_json()


def agent_config(url: str, **kw: Any) -> AgentConfig:
    base: dict[str, Any] = dict(base_url=url, model="scripted-model", api_key_env=KEY_VAR,
                                retries=2, backoff_s=0.01, max_backoff_s=0.05)  # fmt: skip
    return AgentConfig(**{**base, **kw})


def config(out: Path, model: Path, memory: Path, **kw: Any) -> OptimizeConfig:
    base: dict[str, Any] = dict(
        out=str(out), model=str(model), memory=str(memory),
        prompts=tuple((pid, tuple(ids)) for pid, ids in prompts(9, seed=3)),
        start_plan=start_plan(), budget_minutes=10, workers=1, max_new_tokens=MAX_NEW,
        stop_on_eos=False, candidates_per_round=1, forcing_prompts=2, timed_rounds=2,
        timed_per_round=1, profile_prompts=1, profile_config=PROFILE, max_rounds=1,
        limits=TrialLimits(threads=1, request_timeout_s=4.0, memory_bytes=4 << 30),
        modules=("tests.agent_mechs",), registry=False, python_path=(REPO,),
    )  # fmt: skip
    if isinstance(kw.get("agent"), AgentConfig):
        kw["agent"] = kw["agent"].to_json()
    return OptimizeConfig(**{**base, **kw})
