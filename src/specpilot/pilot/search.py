"""Phase 1 candidates: memory first (entries of similar contexts, best first), then Optuna
ask/tell (TPE, seeded) over each mechanism's parameter space (a mechanism without parameters has
the one candidate ``{}``). Declared defaults are not tried as such: they describe the current
setting, so they are usually no-ops.

One Optuna study per mechanism, maximizing the measured speedup; failed trials (MISMATCH, CRASH,
TIMEOUT) are told 0.0 so the sampler moves away from them. Results are always reported through
:meth:`Search.tell`, also after a resume (the study is rebuilt from recorded results with
``add_trial``), so the sampler's history never counts a trial twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specpilot.mechanisms.base import Context, Mechanism, Param
from specpilot.pilot.memory import Memory
from specpilot.plan import Plan


@dataclass(frozen=True)
class Candidate:
    mechanism: str
    params: dict[str, Any] = field(default_factory=dict)
    source: str = "optuna"
    """"memory", "optuna", or "default" (a mechanism without parameters)."""

    @property
    def key(self) -> str:
        return canonical(self.mechanism, self.params)

    def to_json(self) -> dict[str, Any]:
        return {"mechanism": self.mechanism, "params": self.params, "source": self.source}


def canonical(mechanism: str, params: Mapping[str, Any]) -> str:
    return mechanism + json.dumps(dict(params), sort_keys=True, separators=(",", ":"))


def _distribution(p: Param) -> Any:
    import optuna

    if p.kind == "int":
        return optuna.distributions.IntDistribution(int(p.low), int(p.high), log=p.log)  # type: ignore[arg-type]
    if p.kind == "float":
        return optuna.distributions.FloatDistribution(float(p.low), float(p.high), log=p.log)  # type: ignore[arg-type]
    if p.kind == "bool":
        return optuna.distributions.CategoricalDistribution((False, True))
    return optuna.distributions.CategoricalDistribution(tuple(p.choices))


class Search:
    """Candidate generator with one seeded Optuna study per mechanism."""

    def __init__(self, seed: int = 0) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.seed = seed
        self.studies: dict[str, Any] = {}
        self.pending: dict[str, tuple[str, int]] = {}
        """candidate key -> (mechanism, Optuna trial number) asked and not yet told."""
        self.values: dict[str, float] = {}
        """candidate key -> told value (within this run)."""

    def _study(self, mech: str) -> Any:
        if mech not in self.studies:
            sampler = self.optuna.samplers.TPESampler(
                seed=self.seed + len(self.studies), n_startup_trials=4
            )
            self.studies[mech] = self.optuna.create_study(direction="maximize", sampler=sampler)
        return self.studies[mech]

    def tell(self, cand: Candidate, space: Sequence[Param], value: float) -> None:
        """Report a result (speedup, or 0.0 for a failed trial)."""
        key = cand.key
        if key in self.values:
            return
        self.values[key] = value
        study = self._study(cand.mechanism)
        pending = self.pending.pop(key, None)
        if pending is not None:
            study.tell(pending[1], value)
            return
        dists = {p.name: _distribution(p) for p in space}
        params = {k: v for k, v in cand.params.items() if k in dists}
        if not dists or set(params) != set(dists):
            return
        try:
            trial = self.optuna.trial.create_trial(params=params, distributions=dists, value=value)
        except ValueError:
            return  # params outside the (changed) space: nothing to learn from
        study.add_trial(trial)

    def propose(
        self,
        mechs: Sequence[Mechanism],
        ctx: Context,
        plan: Plan,
        memory: Memory | None,
        n: int,
        tried: set[str],
    ) -> list[Candidate]:
        """Up to ``n`` new candidates over ``mechs`` (memory, then Optuna)."""
        out: list[Candidate] = []
        seen = set(tried)

        def add(c: Candidate) -> bool:
            if c.key in seen or len(out) >= n:
                return False
            seen.add(c.key)
            out.append(c)
            return True

        spaces = {m.id: tuple(m.space(ctx, plan)) for m in mechs}
        if memory is not None:
            priors = [p for m in mechs for p in memory.priors(ctx, m.id)]
            for p in sorted(priors, key=lambda p: -p.score):
                if _fits(p.params, spaces[p.mechanism]):
                    add(Candidate(p.mechanism, dict(p.params), "memory"))
        for m in mechs:  # a mechanism without parameters has one candidate
            if not spaces[m.id]:
                add(Candidate(m.id, {}, "default"))
        stalled = 0
        while len(out) < n and stalled < len(mechs):
            stalled = 0
            for m in mechs:
                if len(out) >= n:
                    break
                if not self._ask(m.id, spaces[m.id], add):
                    stalled += 1
        return out

    def _ask(self, mech: str, space: tuple[Param, ...], add: Any) -> bool:
        """One new Optuna candidate for ``mech``; False when its space seems exhausted."""
        if not space:
            return False
        dists = {p.name: _distribution(p) for p in space}
        study = self._study(mech)
        for _ in range(8):
            trial = study.ask(dists)
            cand = Candidate(mech, dict(trial.params), "optuna")
            if add(cand):
                self.pending[cand.key] = (mech, trial.number)
                return True
            # a repeat: close it with what that point already scored (or a neutral 1.0)
            study.tell(trial.number, self.values.get(cand.key, 1.0))
        return False


def propose_useful(
    search: Search,
    mechs: Sequence[Mechanism],
    ctx: Context,
    plan: Plan,
    memory: Memory | None,
    n: int,
    tried: set[str],
    apply: Callable[[Plan, str, Mapping[str, Any]], Plan],
) -> list[Candidate]:
    """Up to ``n`` candidates that change the plan. A dry run of ``apply`` (the mechanism's pure
    plan transform; nothing is built or run) drops no-ops, such as a default equal to the current
    setting, and params that do not apply; those count as tried and teach the sampler 1.0."""
    out: list[Candidate] = []
    base = {k: v for k, v in plan.to_json().items() if k != "mechanisms"}
    spaces = {m.id: m.space(ctx, plan) for m in mechs}
    for _ in range(4):
        got = search.propose(mechs, ctx, plan, memory, n - len(out), tried)
        if not got:
            break
        for c in got:
            tried.add(c.key)
            try:
                new = apply(plan, c.mechanism, c.params)
                useful = {k: v for k, v in new.to_json().items() if k != "mechanisms"} != base
            except ValueError:  # ConfigError included: the params do not apply here
                useful = False
            if useful:
                out.append(c)
            else:
                search.tell(c, spaces[c.mechanism], 1.0)
        if len(out) >= n:
            break
    return out


def _fits(params: Mapping[str, Any], space: Sequence[Param]) -> bool:
    names = {p.name: p for p in space}
    if set(params) != set(names):
        return False
    try:
        for k, v in params.items():
            names[k].check(v)
    except ValueError:
        return False
    return True
