"""The coordinator: rounds of Phase 0 (cost model), Phase 1 (exploration), Phase 2 (integration).

Each round:
  0. profile the current plan in a trial child (the cost model times, so it holds the timing
     slot); the largest factor is the direction, and a second factor within ``near_tie`` (5%) of
     it is explored too. Directions with nothing (left) to try fall through to the next factor,
     and one that already came up empty on the same plan goes last;
  1. candidates for the direction(s) (the run's explorers, :mod:`.choosing`) run as trials in
     parallel (:mod:`.running`): forcing on fresh held-back prompts, then timing against the
     current plan;
  2. winners (PASS, faster by more than ``min_gain``; the best params per mechanism, fastest
     first) are stacked greedily: each is applied on top of the plan so far, forced on the whole
     held-back pool and re-timed against that plan; it is kept only if faster by more than the
     measured run-to-run spread (and ``min_gain``). A speedup above the cost model's ceiling
     (:mod:`.honesty`) is flagged and re-measured before it can be kept.
Everything is recorded by :mod:`.recording` before the next step. Library code: it reports
through ``on_event(kind, payload)`` (:mod:`.events`) and never prints. :meth:`Coordinator.stop`
(the CLI calls it on the first SIGINT) ends the run cleanly: the trials in flight end
INTERRUPTED, the round stays open, and ``--resume`` goes on from there.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from specpilot import runtime
from specpilot.errors import ConfigError
from specpilot.mechanisms.base import Context
from specpilot.pilot.choosing import choose, n_directions, order_directions, pick_winners, tried_on
from specpilot.pilot.config import OptimizeConfig, TimedPromptCut, plan_hash, trial_key
from specpilot.pilot.events import EventFn, RoundStart, RunSummary, Start, ignore
from specpilot.pilot.executors import Executor, make_executor
from specpilot.pilot.explorer import BuiltinExplorer, Explorer, ExplorerFactory, ExplorerSetup
from specpilot.pilot.explorer import RoundAsk as Ask
from specpilot.pilot.honesty import above, ceiling
from specpilot.pilot.journal import Journal, RunState, replay
from specpilot.pilot.memory import Memory
from specpilot.pilot.recall import pending, recall_round, recall_steps
from specpilot.pilot.recording import Recorder, forget_flagged
from specpilot.pilot.records import (
    Change,
    Flag,
    Item,
    Outcome,
    PlanJSON,
    RoundSummary,
    RunRecord,
    Steps,
)
from specpilot.pilot.reference import ReferenceCache, ar_decoder
from specpilot.pilot.running import Clock, Pools, Runner, estimate
from specpilot.pilot.search import Search
from specpilot.pilot.steps import all_mechanisms, apply_steps
from specpilot.pilot.trial import INTERRUPTED, PASS, ChildSpec, TrialResult
from specpilot.plan import Plan

INTERRUPTED_WHY = "interrupted (SIGINT); continue with --resume"


class Coordinator:
    """One optimization run (fresh or resumed) in ``cfg.out``. ``explorer_factory`` starts an
    extra explorer (the CLI passes the LLM agents'); ``stop`` may be shared with the caller."""

    def __init__(self, cfg: OptimizeConfig, resume: bool = False, on_event: EventFn | None = None,
                 executor: Executor | None = None, explorer_factory: ExplorerFactory | None = None,
                 stop: threading.Event | None = None) -> None:  # fmt: skip
        self.out = Path(cfg.out).expanduser()
        self.journal = Journal(self.out)
        self.emit = on_event or ignore
        self.state: RunState | None = None
        if resume:
            if not self.journal.exists():
                raise ConfigError(f"--resume {self.out}: no journal.jsonl there; nothing to resume")
            self.state = replay(self.journal)
            saved = OptimizeConfig.from_json(self.state.run.config)
            cfg = replace(saved, budget_minutes=cfg.budget_minutes, workers=cfg.workers,
                          executor=cfg.executor, memory=cfg.memory)  # fmt: skip
        elif self.journal.exists():
            raise ConfigError(
                f"--out {self.out} already holds a run (journal.jsonl); continue it with "
                f"--resume {self.out} or choose another --out"
            )
        self.cfg, self.resume = cfg, resume
        self.executor = executor
        self.factory = explorer_factory
        self.stop_event = stop or threading.Event()
        self.clock = Clock(cfg.budget_minutes, self.state.elapsed if self.state else 0.0)
        self.extra: Explorer | None = None
        self._ready = False

    def stop(self) -> None:
        """Stop cleanly: start nothing new; trials in flight end INTERRUPTED (thread-safe, and
        safe to call from a signal handler)."""
        if not self.stop_event.is_set():
            self.stop_event.set()
            self.emit("stopping", INTERRUPTED_WHY)

    # -- setup -----------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Everything before the first trial: mechanisms, model, prompts, run directory, memory,
        references cache, executor, explorers. User errors (ConfigError) come before the run
        directory is created."""
        if self._ready:
            return
        cfg = self.cfg
        self.mechs = all_mechanisms(cfg.modules, cfg.registry)
        if not self.mechs:
            raise ConfigError("no mechanisms are available; nothing to optimize")
        self._load_model()
        self.out.mkdir(parents=True, exist_ok=True)
        if self.state is None:
            self._start_run()
        assert self.state is not None
        self.memory = Memory(cfg.memory)
        self.memory.add_mechanisms(self.mechs.values())
        self._make_parts()
        for rec in self.state.trials:  # the sampler's history, and memory (idempotent)
            self.recorder.remember(rec)
        forget_flagged(self.memory, self.state.rounds)
        self._ready = True

    def _load_model(self) -> None:
        from specpilot.loading import load_model
        from specpilot.workloads import Prompt, split_holdout

        cfg = self.cfg
        self.loaded = load_model(cfg.model, device=cfg.device, weights=cfg.weights)
        if cfg.texts and not cfg.prompts:
            tok = self.loaded.tokenizer
            enc = tuple((pid, tuple(tok.encode_prompt(t, chat=c))) for pid, t, c in cfg.texts)
            cfg = self.cfg = replace(cfg, prompts=enc, texts=())
        if len(cfg.prompts) < 2:
            raise ConfigError("optimize needs at least 2 prompts (tuning and held-back pools)")
        ids = dict(cfg.prompts)
        tune, held = split_holdout([Prompt(pid, "", False) for pid, _ in cfg.prompts],
                                   cfg.holdout_fraction, cfg.seed)  # fmt: skip
        self.tuning = [(p.id, list(ids[p.id])) for p in tune]
        self.held = [(p.id, list(ids[p.id])) for p in held]
        need = cfg.timed_rounds * cfg.timed_per_round
        if len(self.tuning) < need:
            raise ConfigError(
                f"timing needs {need} distinct tuning prompts ({cfg.timed_rounds} rounds x "
                f"{cfg.timed_per_round}), the workload has {len(self.tuning)}; add prompts"
            )

    def _start_run(self) -> None:
        cfg = self.cfg
        start = (Plan.from_json(cfg.start_plan) if cfg.start_plan
                 else runtime.default_plan(self.loaded))  # fmt: skip
        if cfg.drafter:
            start = start.replace(drafter=cfg.drafter)
        rec = RunRecord(uuid.uuid4().hex[:10], cfg.to_json(), start.to_json())
        rec.elapsed = round(self.clock.elapsed(), 3)
        self.journal.append(rec.to_json())
        self.state = replay(self.journal)

    def _make_parts(self) -> None:
        cfg, st = self.cfg, self.state
        assert st is not None
        run_id = st.run.run_id
        vary = TimedPromptCut(run_id)
        per = cfg.timed_per_round
        timed = [[vary(*p) for p in self.tuning[r * per : (r + 1) * per]]
                 for r in range(cfg.timed_rounds)]  # fmt: skip
        refs = ReferenceCache(self.out / "references.jsonl", self.loaded.fingerprint,
                              cfg.max_new_tokens, cfg.stop_on_eos,
                              ar_decoder(self.loaded, cfg.device, cfg.max_new_tokens,
                                         cfg.stop_on_eos))  # fmt: skip
        if self.executor is None:
            self.executor = make_executor(cfg.executor, cfg.workers, cfg.device, self.stop_event)
        self.builtin = BuiltinExplorer(Search(cfg.seed), self.mechs, self.memory, self.ctx,
                                       self.apply)  # fmt: skip
        self.recorder = Recorder(self.out, self.journal, st, self.memory, self.clock, self.emit,
                                 self.ctx, self.builtin.learn)  # fmt: skip
        pools = Pools(self.tuning, self.held, timed)
        self.runner = Runner(cfg, self.out, self.executor, refs, pools, self.clock,
                             self.stop_event, self.emit, self.spec)  # fmt: skip
        if self.factory is not None:
            self.extra = self.factory(ExplorerSetup(
                cfg, self.out, run_id, self.memory, self.mechs, self.ctx, self.recorder.log_raw,
                list(self.journal.records()), st.plan))  # fmt: skip

    @property
    def explorers(self) -> list[Explorer]:
        return [self.extra, self.builtin] if self.extra is not None else [self.builtin]

    def ctx(self, plan_json: Mapping[str, Any]) -> Context:
        return runtime.context_of(self.loaded, Plan.from_json(plan_json), 1)

    def apply(self, plan: Plan, mid: str, params: Mapping[str, Any]) -> Plan:
        """``plan`` with one mechanism applied, checked in this (trusted) process."""
        return apply_steps(plan, [(mid, params)], self.mechs,
                           lambda q: runtime.context_of(self.loaded, q, 1))  # fmt: skip

    def spec(self, plan: Mapping[str, Any], steps: Sequence[tuple[str, Any]] = ()) -> ChildSpec:
        steps_t = tuple((m, dict(p)) for m, p in steps)
        mods: tuple[str, ...] = ()
        path: tuple[str, ...] = ()
        box = ""
        for ex in self.explorers:
            m, p, b = ex.child_extras(plan, steps_t)
            mods, path, box = (*mods, *m), (*path, *p), box or b
        return ChildSpec(self.cfg.model, dict(plan), steps_t, (*self.cfg.modules, *mods),
                         (*self.cfg.python_path, *path), box, self.cfg.weights)  # fmt: skip

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Run (or resume) until the budget or ``max_rounds`` is spent, nothing is left to try,
        or :meth:`stop`; returns the summary (with the reason it ended)."""
        self.prepare()
        st = self.state
        assert st is not None and self.executor is not None
        try:
            self.emit("start", Start(st.run.run_id, self.resume, self.clock.elapsed(),
                                     self.clock.budget_s, st.plan))  # fmt: skip
            why = self._loop()
            if self.stop_event.is_set():
                why = INTERRUPTED_WHY
            level = self.extra.level if self.extra is not None else None
            return self.recorder.finish(why, self.stop_event.is_set(), level)
        finally:
            self.executor.shutdown()
            self.memory.close()

    def _loop(self) -> str:
        """The rounds; returns why they ended."""
        st = self.state
        assert st is not None
        if pending(self.cfg.recall, st):
            self._recall(st.round)
        stale = 0
        while not self.stop_event.is_set():
            if st.round >= self.cfg.max_rounds:
                return f"{self.cfg.max_rounds} round(s) done (max_rounds)"
            if self.clock.left() <= 0:
                first = " before the first round (raise --budget-minutes)" if not st.rounds else ""
                return f"the budget ({self.clock.budget_s / 60:g} min) is spent{first}"
            kept, why = self._round(st.round)
            if kept is None:
                return why
            stale = 0 if kept else stale + 1
            if stale >= 3:
                return "3 rounds in a row kept nothing"
        return INTERRUPTED_WHY

    def _round(self, rnd: int) -> tuple[bool | None, str]:
        """One round: (True if a change was kept, False if not, None when the run must end;
        why)."""
        st = self.state
        assert st is not None
        plan = st.plan
        prof = st.current.profile
        if prof is None:
            est = estimate("profile", st.profiles, st.trials)
            if self.clock.left() < est:
                return None, self._no_time(f"round {rnd}'s profile", est)
            prof = self.runner.profile(rnd, plan, st.run.run_id)
            self.recorder.profile(prof)
            if prof.status == INTERRUPTED:
                return None, INTERRUPTED_WHY
        factors = prof.factors or {}
        cands = st.current.candidates
        if cands is None:
            order = order_directions(factors, self.cfg.near_tie, plan, st.rounds)
            ask = Ask(rnd, plan, factors, prof.report, tuple(order),
                      n_directions(factors, order, self.cfg.near_tie),
                      self.cfg.candidates_per_round, 0, tried_on(st.trials, plan))  # fmt: skip
            cands = choose(st.run.run_id, ask, self.explorers, self.extra is not None)
            self.recorder.candidates(cands)
        if not cands.items:  # every applicable mechanism's space is exhausted on this plan
            return None, "no mechanism has anything left to try on the current plan"
        self.emit("round", RoundStart(rnd, factors, cands.directions, cands.items,
                                      cands.agent or []))  # fmt: skip
        est = estimate("trial", st.profiles, st.trials)
        results = self.runner.explore(rnd, plan, cands.items, st.current.trials, est,
                                      self.recorder.trial)  # fmt: skip
        if results is None:
            return None, (INTERRUPTED_WHY if self.stop_event.is_set()
                          else self._no_time(f"round {rnd}'s trials", est))  # fmt: skip
        flags = self._explore_flags(prof.report, plan, cands.items, results)
        winners = pick_winners(cands.items, results, self.cfg.min_gain, self.cfg.max_integrate)
        got = self._integrate(rnd, plan, winners, prof.report, flags)
        if got is None:
            return None, INTERRUPTED_WHY
        new_plan, kept = got
        summary = RoundSummary(rnd, plan_hash(plan), new_plan, factors, cands.directions, winners,
                               kept, [Outcome.of(it, results.get(it.key)) for it in cands.items],
                               flags=flags)  # fmt: skip
        if self.extra is not None:
            after = self.extra.after_round(rnd, cands.items, results, kept)
            summary.agent, summary.sandbox = [*(cands.agent or []), *after], self.extra.level
        self.recorder.end_round(summary)
        return bool(kept), ""

    def _no_time(self, what: str, est: float) -> str:
        return (f"the budget has {max(self.clock.left(), 0):.0f} s left, {what} needs about "
                f"{est:.0f} s (raise --budget-minutes)")  # fmt: skip

    def _keep(self, res: TrialResult) -> bool:
        """A whole-pool result worth keeping: lossless and faster than its spread."""
        gain = (res.speedup or 0.0) - 1
        return res.status == PASS and gain > max(res.spread or 0.0, self.cfg.min_gain)

    # -- honesty ---------------------------------------------------------------------------------

    def _ceiling(self, report: Mapping[str, Any] | None, plan: PlanJSON, res: TrialResult
                 ) -> float | None:  # fmt: skip
        if res.status != PASS or not res.plan:
            return None
        return ceiling(report, Plan.from_json(plan), Plan.from_json(res.plan), res.base_tok_s)

    def _explore_flags(self, report: Mapping[str, Any] | None, plan: PlanJSON,
                       items: Sequence[Item], results: Mapping[str, TrialResult]) -> list[Flag]:
        """Phase 1 results above the ceiling: flagged (integration re-measures them), and their
        effects kept out of the memory."""
        flags = []
        for it in items:
            res = results.get(it.key)
            if res is None:
                continue
            lim = self._ceiling(report, plan, res)
            if above(res.speedup, lim):
                assert lim is not None and res.speedup is not None
                flags.append(Flag(it.key, it.mechanism, res.speedup, lim))
                self.memory.forget_effect(it.key)
                self.emit("flag", flags[-1])
        return flags

    def _full_pool(self, rnd: int, kind: str, item: Item, base: PlanJSON,
                   steps: Steps | None = None) -> TrialResult | None:  # fmt: skip
        st = self.state
        assert st is not None
        est = estimate("integrate", st.profiles, st.trials)
        return self.runner.full_pool(rnd, kind, item, base, steps or item.steps,
                                     st.current.trials, est, self.recorder.trial)  # fmt: skip

    def _honest(self, rnd: int, item: Item, base: PlanJSON, res: TrialResult,
                report: Mapping[str, Any] | None) -> tuple[TrialResult | None, Flag | None]:
        """``res`` when within the ceiling; else flagged and re-measured once: (the
        re-measurement or None when it could not run, the flag)."""
        lim = self._ceiling(report, base, res)
        if not above(res.speedup, lim):
            return res, None
        assert lim is not None and res.speedup is not None
        self.memory.forget_effect(item.key)
        key = trial_key(self.state.run.run_id if self.state else "", rnd, "remeasure", base,
                        item.steps)  # fmt: skip
        flag = Flag(item.key, item.mechanism, res.speedup, lim, key)
        self.emit("flag", flag)
        again = self._full_pool(rnd, "remeasure", replace(item, key=key), base)
        if again is None:
            return None, flag
        lim2 = self._ceiling(report, base, again)
        cleared = again.status == PASS and not above(again.speedup, lim2)
        if not cleared:
            self.memory.forget_effect(key)
        return again, replace(flag, remeasured=again.speedup, cleared=cleared)

    def _integrate(self, rnd: int, plan: PlanJSON, winners: Sequence[Change],
                   report: Mapping[str, Any] | None, flags: list[Flag]
                   ) -> tuple[PlanJSON, list[Change]] | None:  # fmt: skip
        """Phase 2: winners stacked greedily; None when a stop was requested."""
        st = self.state
        assert st is not None
        kept: list[Change] = []
        current = plan
        for w in winners:
            item = Item(w.mechanism, w.params, "", "")
            item = replace(item, key=trial_key(st.run.run_id, rnd, "integrate", current,
                                               item.steps))  # fmt: skip
            res, flag = self._full_pool(rnd, "integrate", item, current), None
            if res is not None:
                res, flag = self._honest(rnd, item, current, res, report)
                if flag is not None:
                    flags.append(flag)
            if res is None:
                if self.stop_event.is_set():
                    return None
                break
            ok = flag is None or flag.cleared
            if ok and self._keep(res) and res.plan and res.speedup is not None:
                current = res.plan
                kept.append(replace(w, key=item.key, speedup=res.speedup, spread=res.spread or 0.0))
        return current, kept

    # -- recall ----------------------------------------------------------------------------------

    def _recall(self, rnd: int) -> None:
        """Memory's best remembered winners for this context, stacked and verified on the whole
        held-back pool as one trial; kept (as round ``rnd``) only if lossless and faster than
        the spread."""
        st = self.state
        assert st is not None
        plan = st.plan
        steps = recall_steps(self.memory, self.mechs, self.ctx(plan), Plan.from_json(plan),
                             self.apply)  # fmt: skip
        def run(item: Item, job_steps: Steps) -> TrialResult | None:
            return self._full_pool(rnd, "recall", item, plan, job_steps)

        summary = recall_round(rnd, plan, steps, st.run.run_id, run, self._keep, self.emit)
        if summary is not None:
            self.recorder.end_round(summary)

