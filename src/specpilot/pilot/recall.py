"""Recall: the remembered winners of similar contexts, stacked into one plan and tried first.

Memory ranks each mechanism's remembered effects by ``similarity x (speedup - spread)``
(:meth:`specpilot.pilot.memory.Memory.priors`). Before its first round, a run with such priors
applies the best one of every applicable mechanism to the start plan — weakest first, so the
strongest wins where two set the same field — and verifies and times the stacked plan as one
integration trial on the whole held-back pool. A stack that is lossless and faster by more than
its spread becomes the plan the rounds start from; otherwise the run goes on from the start
plan as if nothing was remembered. Either way the rounds after it explore as usual (the
remembered candidates also come first in Phase 1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specpilot.errors import ConfigError
from specpilot.mechanisms.base import Context, Mechanism
from specpilot.pilot.config import plan_hash, trial_key
from specpilot.pilot.memory import Memory, Prior
from specpilot.plan import Plan

Apply = Callable[[Plan, str, Mapping[str, Any]], Plan]


def recall_steps(
    memory: Memory,
    mechs: Mapping[str, Mechanism],
    ctx: Context,
    plan: Plan,
    apply: Apply,
    min_score: float = 0.02,
) -> list[tuple[str, dict[str, Any]]]:
    """Steps ``[(mechanism, params), ...]`` of the best remembered prior per mechanism that
    applies to ``plan`` here and is worth at least ``min_score`` (similarity-weighted gain over
    1). Each step is checked by applying it (``apply`` raises ConfigError when it does not
    apply); a step that no longer applies once the earlier ones are in is dropped."""
    best: list[Prior] = []
    for m in mechs.values():
        if m.applicable(ctx, plan) is not None:
            continue
        for p in memory.priors(ctx, m.id, limit=1):
            if p.score - p.similarity >= min_score:  # similarity x (speedup - spread - 1)
                best.append(p)
    steps: list[tuple[str, dict[str, Any]]] = []
    current = plan
    for p in sorted(best, key=lambda p: (p.score, p.mechanism)):  # weakest first
        try:
            nxt = apply(current, p.mechanism, p.params)
        except ConfigError:
            continue
        if nxt.replace(mechanisms=()) == current.replace(mechanisms=()):  # already so: skip
            continue
        current = nxt
        steps.append((p.mechanism, dict(p.params)))
    return steps


def label(steps: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """How a recalled stack is named in logs: ``memory[a+b]``."""
    return "memory[" + "+".join(m for m, _ in steps) + "]"


class RecallMixin:
    """The recall round of :class:`specpilot.pilot.coordinator.Coordinator`, which supplies the
    attributes below and ``_ctx``, ``_apply``, ``_full_pool_trial``, ``_beats_spread``,
    ``_end_round`` and ``emit``."""

    cfg: Any
    state: Any
    memory: Memory
    mechs: dict[str, Mechanism]
    run_id: str

    def _recall_pending(self) -> bool:
        """Recall runs once, before anything else of the first round (also after a resume
        that stopped inside it)."""
        st = self.state
        assert st is not None
        return (self.cfg.recall and st.round == 0 and st.current.profile is None
                and all(t["kind"] == "recall" for t in st.trials))  # fmt: skip

    def _recall(self, rnd: int) -> None:
        """Memory's best remembered winners for this context, stacked and verified on the whole
        held-back pool as one trial; kept (as round ``rnd``) only if lossless and faster than
        the spread."""
        from specpilot.pilot.coordinator import _brief

        st = self.state
        assert st is not None
        plan = st.plan

        ctx = self._ctx(plan)  # type: ignore[attr-defined]
        steps = recall_steps(self.memory, self.mechs, ctx, Plan.from_json(plan), self._apply)  # type: ignore[attr-defined]
        if not steps:
            return
        job_steps = [[m, p] for m, p in steps]
        key = trial_key(self.run_id, rnd, "recall", plan, job_steps)
        item = {"mechanism": label(steps), "params": {"steps": job_steps},
                "source": "memory", "direction": "memory", "key": key}  # fmt: skip
        self.emit("round", {"round": rnd, "factors": {}, "directions": ["memory"],
                            "candidates": [item]})  # fmt: skip
        res = self._full_pool_trial(rnd, "recall", key, plan, job_steps, item)  # type: ignore[attr-defined]
        if res is None:
            return
        ok = self._beats_spread(res)  # type: ignore[attr-defined]
        kept = [{**item, "speedup": res["speedup"], "spread": res["spread"]}] if ok else []
        new_plan = res["plan"] if ok and res.get("plan") else plan
        summary = {"type": "round_end", "round": rnd, "base": plan_hash(plan), "plan": new_plan,
                   "factors": {}, "directions": ["memory"], "winners": kept, "kept": kept,
                   "candidates": [{**item, **_brief(res)}]}  # fmt: skip
        self._end_round(summary)  # type: ignore[attr-defined]
