"""The coordinator: rounds of Phase 0 (cost model), Phase 1 (exploration), Phase 2 (integration).

Each round:
  0. profile the current plan in a trial child (the cost model times, so it holds the timing
     slot); the largest factor is the direction, and a second factor within ``near_tie`` (5%) of
     it is explored too. Directions with nothing (left) to try fall through to the next factor,
     and one that already came up empty on the same plan goes last;
  1. candidates for the direction(s) (:mod:`.search`: memory, defaults, Optuna) run as trials in
     parallel: forcing on fresh held-back prompts, then timing against the current plan;
  2. winners (PASS, faster by more than ``min_gain``; the best params per mechanism, fastest
     first) are stacked greedily: each is applied on top of the plan so far, forced on the whole
     held-back pool and re-timed against that plan; it is kept only if faster by more than the
     measured run-to-run spread (and ``min_gain``).
The coordinator is the only writer of the memory and the run directory; every finished trial is
in the journal (fsynced) and the memory before the next step (see :mod:`.journal`). Library code:
it reports through the ``on_event(kind, data)`` callback and never prints.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace
from pathlib import Path
from typing import Any

from specpilot.errors import ConfigError
from specpilot.mechanisms.base import FACTORS, Context, Mechanism
from specpilot.pilot import bridge
from specpilot.pilot.config import (
    PROFILE_KEYS,
    OptimizeConfig,
    TimedPromptCut,
    directions,
    plan_hash,
    trial_key,
)
from specpilot.pilot.executors import Executor, make_executor
from specpilot.pilot.journal import Journal, RunState, replay
from specpilot.pilot.memory import Memory
from specpilot.pilot.proc import TimingSlot
from specpilot.pilot.recall import RecallMixin
from specpilot.pilot.reference import ReferenceCache, ar_decoder
from specpilot.pilot.report import describe_plan
from specpilot.pilot.search import Candidate, Search, pick_winners, propose_useful
from specpilot.pilot.trial import (
    PASS,
    ChildSpec,
    ProfileJob,
    PromptCase,
    TrialJob,
    TrialLimits,
    TrialResult,
)
from specpilot.plan import Plan, save_plan

EventFn = Callable[[str, dict[str, Any]], None]


class Coordinator(RecallMixin):
    """One optimization run (fresh or resumed) in ``cfg.out``."""

    def __init__(
        self,
        cfg: OptimizeConfig,
        resume: bool = False,
        on_event: EventFn | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.out = Path(cfg.out).expanduser()
        self.journal = Journal(self.out)
        self.emit = on_event or (lambda kind, data: None)
        if resume:
            if not self.journal.exists():
                raise ConfigError(f"--resume {self.out}: no journal.jsonl there; nothing to resume")
            state = replay(self.journal)
            saved = OptimizeConfig.from_json(state.run["config"])
            cfg = replace(saved, budget_minutes=cfg.budget_minutes, workers=cfg.workers,
                          executor=cfg.executor, memory=cfg.memory)  # fmt: skip
        elif self.journal.exists():
            raise ConfigError(
                f"--out {self.out} already holds a run (journal.jsonl); continue it with "
                f"--resume {self.out} or choose another --out"
            )
        self.cfg = cfg
        self.resume = resume
        self.state: RunState | None = state if resume else None
        self.executor = executor
        self.t0 = time.monotonic()
        self.elapsed0 = self.state.elapsed if self.state else 0.0

    # -- time ------------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return self.elapsed0 + time.monotonic() - self.t0

    def left(self) -> float:
        return self.cfg.budget_minutes * 60 - self.elapsed()

    def _log(self, rec: dict[str, Any]) -> None:
        rec["elapsed"] = round(self.elapsed(), 3)
        self.journal.append(rec)

    # -- setup -----------------------------------------------------------------------------------

    def _setup(self) -> None:
        from specpilot.loading import load_model

        cfg = self.cfg
        self.loaded = load_model(cfg.model, device=cfg.device)
        if cfg.texts and not cfg.prompts:
            tok = self.loaded.tokenizer
            enc = tuple((pid, tuple(tok.encode_prompt(t, chat=c))) for pid, t, c in cfg.texts)
            cfg = self.cfg = replace(cfg, prompts=enc, texts=())
        if len(cfg.prompts) < 2:
            raise ConfigError("optimize needs at least 2 prompts (tuning and held-back pools)")
        self.out.mkdir(parents=True, exist_ok=True)
        self.mechs = bridge.all_mechanisms(cfg.modules, cfg.registry)
        if not self.mechs:
            raise ConfigError("no mechanisms are available; nothing to optimize")
        if self.state is None:
            start = (
                Plan.from_json(cfg.start_plan)
                if cfg.start_plan
                else bridge.default_plan(self.loaded)
            )
            if cfg.drafter:
                start = start.replace(drafter=cfg.drafter)
            self.run_id = uuid.uuid4().hex[:10]
            self._log({"type": "run", "run_id": self.run_id, "config": cfg.to_json(),
                       "start_plan": start.to_json()})  # fmt: skip
            self.state = replay(self.journal)
        self.run_id = self.state.run["run_id"]
        self.memory = Memory(cfg.memory)
        self.memory.add_mechanisms(self.mechs.values())
        from specpilot.workloads import Prompt, split_holdout

        ps = [Prompt(pid, "", False) for pid, _ in cfg.prompts]
        ids = dict(cfg.prompts)
        tune, held = split_holdout(ps, cfg.holdout_fraction, cfg.seed)
        self.tuning = [(p.id, list(ids[p.id])) for p in tune]
        self.held = [(p.id, list(ids[p.id])) for p in held]
        need = cfg.timed_rounds * cfg.timed_per_round
        if len(self.tuning) < need:
            raise ConfigError(
                f"timing needs {need} distinct tuning prompts ({cfg.timed_rounds} rounds x "
                f"{cfg.timed_per_round}), the workload has {len(self.tuning)}; add prompts"
            )
        vary = TimedPromptCut(self.run_id)
        self.timed = [
            [vary(*p) for p in self.tuning[r * cfg.timed_per_round : (r + 1) * cfg.timed_per_round]]
            for r in range(cfg.timed_rounds)
        ]
        self.refs = ReferenceCache(
            self.out / "references.jsonl",
            self.loaded.fingerprint,
            cfg.max_new_tokens,
            cfg.stop_on_eos,
            ar_decoder(self.loaded, cfg.device, cfg.max_new_tokens, cfg.stop_on_eos),
        )
        self.slot = str(self.out / ".slots" / cfg.device.replace(":", "_")) if (
            cfg.device == "cpu" or cfg.workers > 1
        ) else None  # fmt: skip
        self.search = Search(cfg.seed)
        self.forcing_cursor = 0
        if self.executor is None:
            self.executor = make_executor(cfg.executor, cfg.workers, cfg.device)
        from specpilot.agent.explorer import AgentExplorer

        self.agent = AgentExplorer.start(cfg, self.out, self.run_id, self.memory, self.mechs,
                                         self._ctx, self._log, list(self.journal.records()),
                                         self.state.plan)  # fmt: skip
        for rec in self.state.trials:  # the sampler's history, and memory (idempotent)
            self._remember(rec, replayed=True)

    def _references(self, prompts: Sequence[tuple[str, list[int]]]) -> dict[str, PromptCase]:
        missing = self.refs.missing(prompts)
        for i, (pid, ids) in enumerate(missing):
            if self.left() <= 0:
                raise _OutOfBudget
            self.emit("reference", {"done": i, "total": len(missing), "prompt": pid})
            with TimingSlot(self.slot).shared():  # never while another trial is being timed
                self.refs.get(pid, ids)
        return {pid: PromptCase(pid, tuple(ids), self.refs.get(pid, ids)) for pid, ids in prompts}

    def _spec(self, plan: Mapping[str, Any], steps: Sequence[tuple[str, Any]] = ()) -> ChildSpec:
        steps_t = tuple((m, dict(p)) for m, p in steps)
        mods, path, box = self.agent.child_extras(plan, steps_t) if self.agent else ((), (), "")
        return ChildSpec(self.cfg.model, dict(plan), steps_t, (*self.cfg.modules, *mods),
                         (*self.cfg.python_path, *path), box)  # fmt: skip

    def _ctx(self, plan_json: Mapping[str, Any]) -> Context:
        return bridge.context_of(self.loaded, Plan.from_json(plan_json), 1)

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Run (or resume) until the budget or ``max_rounds`` is spent; returns the summary."""
        self._setup()
        assert self.state is not None and self.executor is not None
        try:
            self.emit("start", {"run_id": self.run_id, "resumed": self.resume,
                                "elapsed": self.elapsed(), "budget_s": self.cfg.budget_minutes * 60,
                                "plan": self.state.plan})  # fmt: skip
            stale = 0
            if self._recall_pending():
                self._recall(self.state.round)
            while self.state.round < self.cfg.max_rounds and self.left() > 0:
                kept = self._round(self.state.round)
                if kept is None:
                    break
                stale = 0 if kept else stale + 1
                if stale >= 3:
                    break
            return self._finish()
        finally:
            self.executor.shutdown()
            self.memory.close()

    def _round(self, rnd: int) -> bool | None:
        """One round; True if a change was kept, False if not, None when out of budget."""
        state = self.state
        assert state is not None
        plan = state.plan
        prof = state.current.profile
        if prof is None:
            if self.left() < self._estimate("profile"):
                return None
            prof = self._profile(rnd, plan)
        factors = prof.get("factors") or {}
        # a direction that already came up empty on this very plan goes after the others
        fruitless = {d for r in state.rounds if r.get("base") == plan_hash(plan) and not r["kept"]
                     for d in r["directions"]}  # fmt: skip
        order = sorted(directions(factors, self.cfg.near_tie), key=lambda f: f in fruitless)
        cands_rec = state.current.candidates
        if cands_rec is None:
            cands_rec = self._choose(rnd, plan, factors, order, prof.get("report"))
        items = cands_rec["items"]
        if not items:  # every applicable mechanism's space is exhausted on this plan
            return None
        self.emit("round", {"round": rnd, "factors": factors, "directions": cands_rec["directions"],
                            "candidates": items, "agent": cands_rec.get("agent", [])})  # fmt: skip
        results = self._explore(rnd, plan, items)
        if results is None:
            return None
        winners = pick_winners(items, results, self.cfg.min_gain, self.cfg.max_integrate)
        new_plan, kept = self._integrate(rnd, plan, winners)
        summary = {
            "type": "round_end", "round": rnd, "base": plan_hash(plan), "plan": new_plan,
            "factors": factors,
            "directions": cands_rec["directions"], "winners": winners, "kept": kept,
            "candidates": [{**it, **_brief(results.get(it["key"]))} for it in items],
        }  # fmt: skip
        if self.agent:
            after = self.agent.after_round(rnd, items, results, kept)
            summary.update(agent=[*cands_rec.get("agent", []), *after], sandbox=self.agent.level)
        self._end_round(summary)
        return bool(kept)

    def _end_round(self, summary: dict[str, Any]) -> None:
        """Log a round_end record and move the run to the next round on its plan."""
        state = self.state
        assert state is not None
        self._log(summary)
        state.rounds.append(summary)
        state.plan = summary["plan"]
        state.round = summary["round"] + 1
        state.current = type(state.current)()
        self._save_outputs()
        self.emit("round_end", summary)

    def _profile(self, rnd: int, plan: Mapping[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        prompts = self.tuning[: cfg.profile_prompts]
        self.emit("profile_start", {"round": rnd})
        t = time.monotonic()
        job = ProfileJob(
            f"{self.run_id}/r{rnd}/profile", self._spec(plan),
            tuple((pid, tuple(ids)) for pid, ids in prompts), dict(cfg.profile_config),
            int(cfg.profile_config.get("max_new_tokens", cfg.max_new_tokens)), cfg.stop_on_eos,
            self._limits(), self.slot, str(self.out / "trials"), tuple(prompts[0][1][:8]),
        )  # fmt: skip
        status, reason, rep = self.executor.profile(job)  # type: ignore[union-attr]
        rec: dict[str, Any] = {"type": "profile", "round": rnd, "status": status, "reason": reason,
                               "seconds": time.monotonic() - t}  # fmt: skip
        if rep is not None:
            rec["factors"] = {f: rep[f"{f}_factor"] for f in FACTORS}
            rec["report"] = {k: rep.get(k) for k in PROFILE_KEYS}
            self._factor_deltas(rec["factors"])
        self._log(rec)
        assert self.state is not None
        self.state.profiles.append(rec)
        self.emit("profile", rec)
        return rec

    def _factor_deltas(self, factors: Mapping[str, float]) -> None:
        """Attribute the factor change since the last profile to the changes kept in between."""
        assert self.state is not None
        prev = [p for p in self.state.profiles if p.get("factors")]
        if not prev or not self.state.rounds:
            return
        before = prev[-1]["factors"]
        deltas = {f: factors[f] - before[f] for f in FACTORS}
        for k in self.state.rounds[-1].get("kept", []):
            self.memory.set_factor_deltas(k["key"], deltas)

    def _choose(self, rnd: int, plan: Mapping[str, Any], factors: Mapping[str, float],
                order: list[str], report: Mapping[str, Any] | None = None
                ) -> dict[str, Any]:  # fmt: skip
        p = Plan.from_json(plan)
        ctx = self._ctx(plan)
        tried = {Candidate(t["steps"][-1][0], t["steps"][-1][1]).key
                 for t in (self.state.trials if self.state else [])
                 if t["steps"] and t.get("base") == plan_hash(plan)}  # fmt: skip
        top = factors.get(order[0], 1.0)
        n_dir = (
            2
            if len(order) > 1 and factors.get(order[1], 1.0) >= top * (1 - self.cfg.near_tie)
            else 1
        )
        chosen: list[str] = []
        items: list[dict[str, Any]] = []
        agent_log: list[dict[str, Any]] = []
        if self.agent:  # the agents' candidates first; the built-in explorer fills the round
            got_a, agent_log = self.agent.propose(rnd, plan, factors, report, order, tried)
            for it in got_a:
                steps = [[it["mechanism"], it["params"]]]
                items.append({**it, "key": trial_key(self.run_id, rnd, "explore", plan, steps)})
        for f in order:  # a factor with nothing (left) to try falls through
            want = self.cfg.candidates_per_round - len(items)
            if want <= 0 or (len(chosen) >= n_dir and items):
                break
            mechs = [m for m in self.mechs.values()
                     if m.factor == f and m.applicable(ctx, p) is None]  # fmt: skip
            share = max(1, want // 2) if len(chosen) + 1 < n_dir else want
            got = self._propose(mechs, ctx, p, share, tried) if mechs else []
            if not got:
                continue
            chosen.append(f)
            for c in got:
                tried.add(c.key)
                steps = [[c.mechanism, c.params]]
                key = trial_key(self.run_id, rnd, "explore", plan, steps)
                items.append({**c.to_json(), "direction": f, "key": key})
        chosen += [d for d in dict.fromkeys(it["direction"] for it in items) if d not in chosen]
        rec = {"type": "candidates", "round": rnd, "directions": chosen, "items": items}
        if self.agent:
            rec["agent"] = agent_log
        self._log(rec)
        return rec

    def _propose(
        self, mechs: list[Mechanism], ctx: Context, plan: Plan, n: int, tried: set[str]
    ) -> list[Candidate]:
        return propose_useful(self.search, mechs, ctx, plan, self.memory, n, tried, self._apply)

    def _apply(self, plan: Plan, mid: str, params: Mapping[str, Any]) -> Plan:
        """``plan`` with one mechanism applied, checked in this (trusted) process."""
        return bridge.apply_steps(plan, [(mid, params)], self.mechs,
                                  lambda q: bridge.context_of(self.loaded, q, 1))  # fmt: skip

    def _beats_spread(self, res: Mapping[str, Any]) -> bool:
        """A whole-pool result worth keeping: lossless and faster than its spread."""
        gain = (res.get("speedup") or 0.0) - 1
        return res["status"] == PASS and gain > max(res.get("spread") or 0.0, self.cfg.min_gain)

    def _explore(self, rnd: int, plan: Mapping[str, Any], items: list[dict[str, Any]]
                 ) -> dict[str, dict[str, Any]] | None:  # fmt: skip
        assert self.state is not None
        done = dict(self.state.current.trials)
        todo = [it for it in items if it["key"] not in done]
        futures: dict[Future[TrialResult], dict[str, Any]] = {}
        while todo or futures:
            while todo and len(futures) < self.executor.workers:  # type: ignore[union-attr]
                forcing = self._forcing_sample()
                try:  # the references first: they take time too
                    self._references([*forcing, *(p for r in self.timed for p in r)])
                except _OutOfBudget:
                    todo = []
                    break
                if self.left() < self._estimate("trial"):
                    todo = []
                    break
                it = todo.pop(0)
                job = self._job(rnd, it["key"], plan, [[it["mechanism"], it["params"]]], forcing)
                self.emit("trial_start", {"round": rnd, "kind": "explore", **it})
                futures[self.executor.submit(job)] = it  # type: ignore[union-attr]
            if not futures:
                break
            finished, _ = wait(list(futures), return_when=FIRST_COMPLETED)
            for fut in finished:
                it = futures.pop(fut)
                res = fut.result()
                done[it["key"]] = self._record(rnd, "explore", it["key"], plan,
                                               [[it["mechanism"], it["params"]]], res)  # fmt: skip
        if any(it["key"] not in done for it in items) and not done:
            return None
        return done

    def _forcing_sample(self) -> list[tuple[str, list[int]]]:
        """The next ``forcing_prompts`` held-back prompts (rotating through the pool)."""
        n = min(self.cfg.forcing_prompts, len(self.held))
        out = [self.held[(self.forcing_cursor + i) % len(self.held)] for i in range(n)]
        self.forcing_cursor = (self.forcing_cursor + n) % len(self.held)
        return out

    def _job(self, rnd: int, key: str, base: Mapping[str, Any], steps: list[list[Any]],
             forcing: Sequence[tuple[str, list[int]]]) -> TrialJob:  # fmt: skip
        cases = self._references([*forcing, *(p for r in self.timed for p in r)])
        cfg = self.cfg
        return TrialJob(
            key, self._spec(base, [(m, p) for m, p in steps]), self._spec(base),
            tuple(cases[pid] for pid, _ in forcing),
            tuple(tuple(cases[pid] for pid, _ in r) for r in self.timed),
            cfg.max_new_tokens, cfg.stop_on_eos, self._limits(), self.slot,
            str(self.out / "trials"), tuple(self.tuning[0][1][:8]),
        )  # fmt: skip

    def _record(self, rnd: int, kind: str, key: str, base: Mapping[str, Any],
                steps: list[list[Any]], res: TrialResult) -> dict[str, Any]:  # fmt: skip
        rec = {"type": "trial", "round": rnd, "kind": kind, "key": key, "base": plan_hash(base),
               "base_plan": dict(base), "steps": steps, "result": res.to_json()}  # fmt: skip
        self._log(rec)  # durable first, then memory (idempotent by key), then the sampler
        assert self.state is not None
        self.state.trials.append(rec)
        self.state.current.trials[key] = rec["result"]
        self._remember(rec)
        self.emit("trial_done", {"round": rnd, "kind": kind, "key": key, "steps": steps,
                                 "result": rec["result"]})  # fmt: skip
        return rec["result"]

    def _remember(self, rec: Mapping[str, Any], replayed: bool = False) -> None:
        res = rec["result"]
        base = rec.get("base_plan") or (self.state.plan if self.state else {})
        pool = "full" if rec["kind"] in ("integrate", "recall") else "sample"
        steps = [(m, p) for m, p in rec["steps"]]
        ctx = self._ctx(base)
        self.memory.record_trial(rec["key"], self.run_id, rec["round"], rec["kind"], ctx, steps,
                                 res, pool)  # fmt: skip
        if rec["kind"] == "explore" and rec["steps"]:
            mid, params = rec["steps"][-1]
            mech = self.mechs.get(mid)
            if mech is not None:
                p = Plan.from_json(base)
                value = res["speedup"] if res["status"] == PASS and res.get("speedup") else 0.0
                self.search.tell(Candidate(mid, params), mech.space(self._ctx(base), p), value)

    def _integrate(self, rnd: int, plan: dict[str, Any], winners: list[dict[str, Any]]
                   ) -> tuple[dict[str, Any], list[dict[str, Any]]]:  # fmt: skip
        assert self.state is not None
        kept: list[dict[str, Any]] = []
        current = plan
        for w in winners:
            steps = [[w["mechanism"], w["params"]]]
            key = trial_key(self.run_id, rnd, "integrate", current, steps)
            res = self._full_pool_trial(rnd, "integrate", key, current, steps, w)
            if res is None:
                break
            if self._beats_spread(res) and res.get("plan"):
                current = res["plan"]
                kept.append({**w, "key": key, "speedup": res["speedup"], "spread": res["spread"]})
        return current, kept

    def _full_pool_trial(self, rnd: int, kind: str, key: str, base: Mapping[str, Any],
                         steps: list[list[Any]], item: Mapping[str, Any]
                         ) -> dict[str, Any] | None:  # fmt: skip
        """``steps`` on ``base`` forced on the whole held-back pool and timed (or its recorded
        result after a resume); None when the budget cannot pay for it."""
        assert self.state is not None
        res = self.state.current.trials.get(key)
        if res is not None:
            return res
        try:
            self._references([*self.held, *(p for r in self.timed for p in r)])
        except _OutOfBudget:
            return None
        if self.left() < self._estimate("integrate"):
            return None
        job = self._job(rnd, key, base, steps, self.held)
        self.emit("trial_start", {"round": rnd, "kind": kind, **item, "key": key})
        return self._record(rnd, kind, key, base, steps,
                            self.executor.submit(job).result())  # type: ignore[union-attr]  # fmt: skip

    def _limits(self) -> TrialLimits:
        """The configured limits, capped so a trial ends at most a minute after the budget."""
        cap = max(self.left(), 0.0) + 60.0
        lim = self.cfg.limits
        return replace(lim, trial_timeout_s=min(lim.trial_timeout_s, cap),
                       setup_timeout_s=min(lim.setup_timeout_s, cap),
                       request_timeout_s=min(lim.request_timeout_s, cap))  # fmt: skip

    def _estimate(self, what: str) -> float:
        assert self.state is not None
        if what == "profile":
            secs = [p.get("seconds", 0.0) for p in self.state.profiles]
            return min(secs[-1], 240.0) if secs else 60.0
        durs = [t["result"].get("duration_s", 0.0) for t in self.state.trials
                if t["kind"] == ("integrate" if what == "integrate" else "explore")]  # fmt: skip
        if durs:
            return sum(durs[-6:]) / len(durs[-6:])
        return 90.0 if what == "integrate" else 45.0

    # -- outputs ---------------------------------------------------------------------------------

    def _save_outputs(self) -> None:
        """plan.json, rounds.jsonl and report.html, each rewritten whole from the state."""
        from specpilot.pilot.report import write_report

        st = self.state
        assert st is not None
        save_plan(Plan.from_json(st.plan), self.out / "plan.json")
        lines = "".join(
            json.dumps({k: v for k, v in r.items() if k != "type"}) + "\n" for r in st.rounds
        )
        tmp = self.out / ".rounds.jsonl.tmp"
        tmp.write_text(lines)
        tmp.replace(self.out / "rounds.jsonl")
        write_report(self.out / "report.html", st.run, st.profiles, st.rounds, st.trials, st.plan)

    def _finish(self) -> dict[str, Any]:
        assert self.state is not None
        st = self.state
        self._save_outputs()
        counts: dict[str, int] = {}
        for t in st.trials:
            counts[t["result"]["status"]] = counts.get(t["result"]["status"], 0) + 1
        gain = 1.0
        for r in st.rounds:
            for k in r.get("kept", []):
                gain *= k["speedup"]
        summary = {
            "run_id": self.run_id, "out": str(self.out), "rounds": len(st.rounds),
            "trials": len(st.trials), "statuses": counts, "elapsed_s": self.elapsed(),
            "start_plan": describe_plan(st.run["start_plan"]),
            "final_plan": describe_plan(st.plan), "loop_speedup": gain,
            "kept": [k for r in st.rounds for k in r.get("kept", [])],
        }  # fmt: skip
        if self.agent:
            summary["sandbox"] = self.agent.level
        self.emit("done", summary)
        return summary


class _OutOfBudget(Exception):
    """The budget ran out while computing references (nothing is lost: they are cached)."""


def _brief(res: Mapping[str, Any] | None) -> dict[str, Any]:
    if not res:
        return {"status": "NOT RUN"}
    return {k: res.get(k) for k in ("status", "reason", "speedup", "spread", "tau")}
