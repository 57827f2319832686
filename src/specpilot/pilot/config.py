"""Configuration of a run (:class:`OptimizeConfig`), idempotency keys and the direction order."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from specpilot.errors import ConfigError
from specpilot.mechanisms.base import FACTORS
from specpilot.pilot.trial import TrialLimits

PROFILE_KEYS = (
    "tau_factor", "kernel_factor", "overhead_factor", "gap", "direction", "n_star",
    "tau_actual", "tau_opt", "kernels", "wall_step_ms", "kernel_step_ms", "mismatches",
    "tau_drafter", "tau_drafters",
)  # fmt: skip


@dataclass(frozen=True)
class OptimizeConfig:
    """Everything a run needs; validated here (the CLI passes flags through)."""

    out: str
    model: str = "smollm2-135m"
    memory: str = "~/.cache/specpilot/memory.sqlite"
    prompts: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(id, token ids) of the whole workload; split into tuning and held-back pools here."""
    texts: tuple[tuple[str, str, bool], ...] = ()
    """(id, text, chat) prompts, encoded with the model's tokenizer when the run starts (the
    journal keeps the encoded ``prompts``)."""
    start_plan: Mapping[str, Any] | None = None
    """Plan JSON to start from (default: the runtime's default plan for the model)."""
    drafter: str | None = None
    """Override the start plan's drafter."""
    budget_minutes: float = 17.0
    workers: int = 1
    executor: str = "local"
    device: str = "cpu"
    weights: str = "auto"
    """``load_model``'s weights mode for the parent and every trial child (auto / fp32 / native)."""
    seed: int = 0
    holdout_fraction: float = 0.3
    max_new_tokens: int = 64
    stop_on_eos: bool = True
    candidates_per_round: int = 4
    forcing_prompts: int = 3
    timed_rounds: int = 3
    timed_per_round: int = 2
    profile_prompts: int = 2
    profile_config: Mapping[str, Any] = field(
        default_factory=lambda: {"max_new_tokens": 32, "max_budget": 16, "replay_depth": 8,
                                 "verify_repeats": 2, "draft_samples": 8}
    )  # fmt: skip
    """:class:`specpilot.costmodel.ProfileConfig` fields of each round's Phase 0 (kept small:
    it runs every round, inside the budget)."""
    max_rounds: int = 8
    max_integrate: int = 2
    near_tie: float = 0.05
    min_gain: float = 0.02
    limits: TrialLimits = field(default_factory=TrialLimits)
    modules: tuple[str, ...] = ()
    """Extra mechanism modules (each exposes ``MECHANISMS``)."""
    registry: bool = True
    """Explore the package's registered mechanisms (False: only ``modules``' ones)."""
    recall: bool = True
    """Before the first round, try memory's best remembered winners stacked (:mod:`.recall`)."""
    python_path: tuple[str, ...] = ()
    agent: Mapping[str, Any] | None = None
    """Settings of the LLM agents proposing mechanisms (``--agent``: the JSON of
    :class:`specpilot.agent.config.AgentConfig`, validated by the CLI and read by the agent
    explorer the CLI wires in); None = the built-in explorer only."""
    reuse_agent_mechanisms: bool = True
    """Re-apply agent-written mechanisms stored in the memory (sandboxed, forced again)."""

    def __post_init__(self) -> None:
        if self.budget_minutes <= 0:
            raise ConfigError(f"--budget-minutes must be positive, got {self.budget_minutes}")
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.executor not in ("local", "ray"):
            raise ConfigError(f"--executor must be local or ray, got {self.executor!r}")
        for name in ("candidates_per_round", "forcing_prompts", "timed_rounds", "timed_per_round",
                     "profile_prompts", "max_rounds", "max_new_tokens"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.holdout_fraction < 1:
            raise ConfigError("holdout_fraction must be strictly between 0 and 1")
        from specpilot.loading import WEIGHTS

        if self.weights not in WEIGHTS:
            raise ConfigError(
                f"--weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}"
            )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["prompts"] = [[pid, list(ids)] for pid, ids in self.prompts]
        d["texts"] = [list(t) for t in self.texts]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> OptimizeConfig:
        try:
            d = dict(d)
            d["prompts"] = tuple((str(p), tuple(ids)) for p, ids in d["prompts"])
            d["texts"] = tuple((str(a), str(b), bool(c)) for a, b, c in d.get("texts", ()))
            d["limits"] = TrialLimits(**d["limits"])
            for k in ("modules", "python_path"):
                d[k] = tuple(d[k])
            if d.get("agent") is not None and not isinstance(d["agent"], Mapping):
                raise TypeError("agent: expected an object")
            return cls(**d)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"--resume: the run's saved configuration does not fit this specpilot ({e}); "
                "resume it with the version that started it"
            ) from None


def plan_hash(plan_json: Mapping[str, Any]) -> str:
    blob = json.dumps(plan_json, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def trial_key(run_id: str, rnd: int, kind: str, base: Mapping[str, Any], steps: Any) -> str:
    """Idempotency key: the same run, round, kind, base plan and steps are the same trial."""
    blob = json.dumps([plan_hash(base), steps], sort_keys=True, separators=(",", ":"))
    return f"{run_id}/r{rnd}/{kind}/{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def directions(factors: Mapping[str, float], near_tie: float) -> list[str]:
    """Factors in exploration order, largest first (ties: tau, kernel, overhead). The round's
    directions are the first, plus the second when within ``near_tie`` of it
    (:func:`specpilot.pilot.choosing.n_directions`); a factor with nothing left to try falls
    through to the next."""
    return sorted(FACTORS, key=lambda f: (-factors.get(f, 1.0), FACTORS.index(f)))


class TimedPromptCut:
    """Timed prompts end a few tokens early, by a cut drawn per run (seeded by the run id, so a
    resume draws the same): the workloads are public, so a candidate could otherwise decode them
    during its untimed setup and answer timed requests from that cache. Before its first timed
    request it cannot know the prompts, and it is stopped outside its requests."""

    def __init__(self, run_id: str) -> None:
        self.rng = random.Random(run_id)

    def __call__(self, pid: str, ids: list[int]) -> tuple[str, list[int]]:
        if len(ids) < 12:
            return pid, ids
        cut = self.rng.randint(1, min(8, len(ids) // 4))
        return f"{pid}~{cut}", ids[:-cut]
