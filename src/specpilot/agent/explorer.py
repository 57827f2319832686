"""The agents' side of the pilot loop: :class:`AgentExplorer`, an extra explorer of the run
(it implements :class:`specpilot.pilot.explorer.Explorer`; the CLI wires it in through
:func:`agent_explorer`, the pilot never imports this package).

Each round, one agent per worker (directions: the round's factors, largest first, round-robin)
is sent :func:`.prompt.messages` and answers with a parameter proposal or a new mechanism. Every
reply goes through: parse (:mod:`.parse`) -> static check (:mod:`.static`) -> written to
``RUN_DIR/agent/<sha16>/`` -> described by a sandboxed child (:mod:`.store`) -> registered as a
stand-in (:class:`.store.AgentMechanism`). A rejection at any stage is recorded with its reason,
added to that agent's failures (shown to it next time), and the agent is asked again, up to
``requests_per_round`` times. Endpoint failures (down, timeouts, 429, 5xx) are retried with
backoff by :mod:`.client`; after that the agent sits the round out and the built-in explorer
fills the round. Accepted candidates run as ordinary trials (forcing, then timing), in sandboxed
children (:meth:`AgentExplorer.child_extras`); a kept agent mechanism's source and provenance go
to the memory, and later runs re-apply it without the LLM (still sandboxed, still forced).

The coordinator process never imports agent-written code: it parses, hashes and writes it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from specpilot.agent import client as cl
from specpilot.agent import prompt
from specpilot.agent.config import AgentConfig
from specpilot.agent.parse import PARAMS, ParseError, Proposal, parse_reply
from specpilot.agent.static import StaticReject, check_source
from specpilot.agent.store import (
    AgentModule,
    Describer,
    params_of,
    sha256,
    source_ok,
    write_source,
)
from specpilot.errors import ConfigError
from specpilot.mechanisms.base import Context, Mechanism, check_params
from specpilot.pilot import steps as pilot_steps
from specpilot.pilot.explorer import ExplorerSetup, Proposals, RoundAsk
from specpilot.pilot.records import Change, Item
from specpilot.pilot.sandbox import SandboxSpec, probe, read_paths
from specpilot.pilot.search import canonical
from specpilot.pilot.trial import TrialResult
from specpilot.plan import Plan

STRONG = ("landlock", "netns")


@dataclass
class _Rejected(Exception):
    stage: str
    """parse, params, static, describe."""
    reason: str
    status: str = "rejected"


@dataclass
class _Accepted:
    mechanism: str
    params: dict[str, Any]
    module: AgentModule | None = None
    note: str = ""


@dataclass
class _AgentRound:
    entries: list[dict[str, Any]] = field(default_factory=list)
    accepted: list[tuple[_Accepted, dict[str, Any]]] = field(default_factory=list)


class AgentExplorer:
    """Agents, their sandbox and their modules for one run (see the module docstring)."""

    def __init__(self, cfg: Any, out: Path, run_id: str, memory: Any,
                 mechs: dict[str, Mechanism], ctx_of: Callable[[Mapping[str, Any]], Context],
                 log: Callable[[dict[str, Any]], None]) -> None:  # fmt: skip
        self.cfg = cfg
        self.acfg = AgentConfig.from_json(cfg.agent) if cfg.agent is not None else None
        self.out, self.run_id, self.memory, self.mechs = out.resolve(), run_id, memory, mechs
        self.ctx_of, self.log = ctx_of, log
        self.root = self.out / "agent"
        self.src = self.root / "src"
        self.src.mkdir(parents=True, exist_ok=True)
        self.layers = self._layers()
        mem = str(Path(cfg.memory).expanduser().resolve())
        self.protected = (str(self.out), mem, mem + "-wal", mem + "-shm", mem + "-journal")
        self.read = self._read_paths()
        self.modules: dict[str, AgentModule] = {}
        self.by_id: dict[str, AgentModule] = {}
        self.failures: dict[int, list[dict[str, Any]]] = {}
        self.client: cl.ChatClient | None = None
        self.key_set = False
        if self.acfg is not None:
            key = os.environ.pop(self.acfg.api_key_env, None)  # no child inherits it
            self.client = cl.ChatClient(self.acfg, key)
            self.key_set = bool(key)

    @property
    def level(self) -> str:
        return "+".join(self.layers)

    @classmethod
    def start(cls, cfg: Any, out: Path, run_id: str, memory: Any, mechs: dict[str, Mechanism],
              ctx_of: Callable[[Mapping[str, Any]], Context], log: Callable[[dict[str, Any]], None],
              records: Sequence[Mapping[str, Any]], plan: Mapping[str, Any]
              ) -> AgentExplorer | None:  # fmt: skip
        """The run's explorer, or None when there is nothing agent-written to run (no
        ``--agent``, nothing stored in memory, nothing in the journal): the loop then runs
        exactly as without this package."""
        journaled = [e for r in records if r.get("type") in ("candidates", "agent_reuse")
                     for e in r.get("agent", []) if e.get("module")]  # fmt: skip
        stored = memory.agent_sources() if cfg.reuse_agent_mechanisms else []
        if cfg.agent is None and not stored and not journaled:
            return None
        self = cls(cfg, out, run_id, memory, mechs, ctx_of, log)
        if not any(r.get("type") == "agent_start" for r in records):
            who = None
            if self.acfg is not None:
                key = "set" if self.key_set else "unset"
                who = {"endpoint": self.acfg.endpoint, "model": self.acfg.model, "key": key}
            log({"type": "agent_start", "sandbox": self.level, "agent": who})
        for e in journaled:  # a resumed run: its modules as they were described
            m = AgentModule(**e["module"])
            if source_ok(m) and m.sha not in self.modules:
                self._register(m)
        fresh = [s for s in stored if s["sha256"] not in self.modules]
        if fresh:
            self._reuse(fresh, plan)
        return self

    # -- setup -----------------------------------------------------------------------------------

    def _layers(self) -> tuple[str, ...]:
        want = self.acfg.sandbox if self.acfg is not None else "auto"
        if want == "audit":
            return ("audit",)
        found = probe()
        if want == "strong" and not all(x in found for x in STRONG):
            raise ConfigError(
                f"agent sandbox 'strong' needs Landlock and user namespaces; this machine has "
                f"only {'+'.join(found)} (use the default 'auto' to accept that, see docs/agent.md)"
            )
        return found

    def _read_paths(self) -> tuple[str, ...]:
        from specpilot.loading import resolve_spec
        from specpilot.loading.cache import cache_root

        extra = [str(cache_root()), *self.cfg.python_path]
        with contextlib.suppress(Exception):  # the coordinator has loaded it; else nothing to add
            extra.append(str(resolve_spec(self.cfg.model)))
        paths, conflicts = read_paths(extra, self.protected)
        paths = (*paths, str(self.src.resolve()))  # inside the run directory: only this
        if conflicts:
            raise ConfigError(
                f"the trial sandbox must read {', '.join(conflicts)}, which contains the run "
                "directory or the memory database; choose --out / --memory outside it"
            )
        return paths

    def sandbox(self) -> SandboxSpec:
        return SandboxSpec(self.layers, self.read, self.protected)

    def _register(self, m: AgentModule) -> None:
        self.modules[m.sha] = m
        stand_ins = m.stand_ins()
        for s in stand_ins:
            self.mechs[s.id] = s
            self.by_id[s.id] = m
        self.memory.add_mechanisms(stand_ins)

    def _describer(self, ctx: Context, plan: Mapping[str, Any]) -> Describer:
        return Describer(ctx, plan, self.sandbox(), self.cfg.python_path, self.root / "logs",
                         self.cfg.limits.memory_bytes)  # fmt: skip

    def _reuse(self, stored: Sequence[Mapping[str, Any]], plan: Mapping[str, Any]) -> None:
        """Stored modules (memory): static check, write, describe, register; journaled."""
        entries, todo = [], []
        for s in stored:
            try:
                infos = check_source(s["source"], self._taken())
            except StaticReject as e:
                entries.append({"stage": "static", "status": "rejected", "sha": s["sha256"],
                                "reason": str(e)})  # fmt: skip
                continue
            m = write_source(self.root, s["source"])
            m.origin = {k: s.get(k) for k in ("model", "endpoint", "run_id", "round")}
            todo.append((m, [(x.id, x.factor) for x in infos]))
        describer = self._describer(self.ctx_of(plan), plan)
        try:
            outcomes = [describer.describe(m) for m, _ in todo]
        finally:
            describer.close()
        for (m, static), got in zip(todo, outcomes, strict=True):
            ids = [(d["id"], d["factor"]) for d in got.mechanisms]
            if got.ok and (ids != static or {i for i, _ in ids} & set(self.mechs)):
                why = f"described ids {ids} differ from the source's or are taken"
                got = replace(got, ok=False, status="rejected", reason=why)
            if got.ok:
                m.mechanisms = got.mechanisms
                self._register(m)
                entries.append({"stage": "accepted", "status": "reused", "sha": m.sha,
                                "module": m.to_json()})  # fmt: skip
            else:
                entries.append({"stage": "describe", "status": got.status, "sha": m.sha,
                                "reason": got.reason})  # fmt: skip
        self.log({"type": "agent_reuse", "agent": entries})

    def _taken(self) -> frozenset[str]:
        """Ids a new module may not use: every known mechanism, built-in ones included."""
        from specpilot.mechanisms import all_mechanisms

        return frozenset({*self.mechs, *(m.id for m in all_mechanisms())})

    # -- the hook --------------------------------------------------------------------------------

    def child_extras(
        self, plan: Mapping[str, Any], steps: Sequence[tuple[str, Any]]
    ) -> tuple[tuple[str, ...], tuple[str, ...], str]:
        """(modules, python path, sandbox JSON) of a child building ``plan`` + ``steps``: only
        the agent modules it needs are on its path; every child of the run is sandboxed."""
        ids = [m.get("id") for m in plan.get("mechanisms", [])] + [s[0] for s in steps]
        mods = list({self.by_id[i].sha: self.by_id[i] for i in ids if i in self.by_id}.values())
        path = (str(self.src.resolve()),) if mods else ()
        return tuple(m.module for m in mods), path, self.sandbox().to_arg()

    def propose(self, ask: RoundAsk) -> Proposals:
        """This round's agent candidates (without keys) and the agents' log."""
        items, log = self._propose(ask.round, ask.plan, ask.factors, ask.report, ask.order,
                                   ask.tried)  # fmt: skip
        return Proposals(items, [], log)

    def _propose(self, rnd: int, plan: Mapping[str, Any], factors: Mapping[str, float],
                 report: Mapping[str, Any] | None, order: Sequence[str], tried: set[str]
                 ) -> tuple[list[Item], list[dict[str, Any]]]:  # fmt: skip
        if self.client is None or self.acfg is None or not order:
            return [], []
        ctx, p = self.ctx_of(plan), Plan.from_json(plan)
        avail = [{"id": m.id, "factor": m.factor, "description": m.description,
                  "space": [asdict(x) for x in m.space(ctx, p)]}
                 for m in self.mechs.values() if m.applicable(ctx, p) is None]  # fmt: skip
        keys = ("mechanism_id", "params", "speedup", "spread", "kind", "device", "arch")
        memory = [{k: e.get(k) for k in keys} for e in self.memory.list_entries(10)]
        n = self.acfg.agents or max(1, self.cfg.workers)
        briefs = [prompt.RoundBrief(rnd, order[i % len(order)], dict(factors), dict(report or {}),
                                    dict(plan), avail, memory) for i in range(n)]  # fmt: skip
        with ThreadPoolExecutor(n, thread_name_prefix="specpilot-agent") as pool:
            rounds = list(pool.map(lambda i: self._guarded(i, briefs[i], ctx, p, tried), range(n)))
        items: list[Item] = []
        log: list[dict[str, Any]] = []
        for i, ar in enumerate(rounds):
            log.extend(ar.entries)
            for acc, entry in ar.accepted:
                if acc.module is not None and acc.module.sha not in self.modules:
                    clash = sorted({x["id"] for x in acc.module.mechanisms} & set(self.mechs))
                    if clash:  # another agent registered the same id this round
                        entry.update(stage="static", status="rejected",
                                     reason=f"mechanism id(s) {clash} already taken")  # fmt: skip
                        continue
                    self._register(acc.module)
                    acc.module.origin["round"] = rnd
                key = canonical(acc.mechanism, acc.params)
                if key in tried:
                    continue
                tried.add(key)
                items.append(Item(acc.mechanism, acc.params, "agent", briefs[i].direction,
                                  agent=i))  # fmt: skip
        return items, log

    def _guarded(self, i: int, brief: prompt.RoundBrief, ctx: Context, plan: Plan,
                 tried: set[str]) -> _AgentRound:  # fmt: skip
        """:meth:`_ask`; a harness error is recorded, never raised: the round goes on."""
        try:
            return self._ask(i, brief, ctx, plan, set(tried))
        except Exception as e:
            why = f"harness error: {type(e).__name__}: {e}"[:500]
            entry = {"agent": i, "direction": brief.direction, "request": -1}
            return _AgentRound([{**entry, "stage": "internal", "status": "error", "reason": why}])

    def _ask(self, i: int, brief: prompt.RoundBrief, ctx: Context, plan: Plan, tried: set[str]
             ) -> _AgentRound:  # fmt: skip
        """One agent's round (a worker thread: no memory or journal writes here)."""
        assert self.client is not None and self.acfg is not None
        out = _AgentRound()
        failures = self.failures.setdefault(i, [])
        describer = self._describer(ctx, plan.to_json())
        try:
            self._requests(i, brief, ctx, plan, tried, out, failures, describer)
        finally:
            describer.close()
        return out

    def _requests(self, i: int, brief: prompt.RoundBrief, ctx: Context, plan: Plan,
                  tried: set[str], out: _AgentRound, failures: list[dict[str, Any]],
                  describer: Describer) -> None:  # fmt: skip
        assert self.client is not None and self.acfg is not None
        for req in range(self.acfg.requests_per_round):
            if len(out.accepted) >= self.acfg.candidates:
                break
            entry: dict[str, Any] = {"agent": i, "direction": brief.direction, "request": req}
            out.entries.append(entry)
            try:
                msgs = prompt.messages(brief, failures, self.acfg.max_prompt_chars)
                text, attempts = self.client.complete(msgs)
            except cl.AgentError as e:
                entry.update(stage="endpoint", status=e.kind, reason=e.reason, attempts=e.attempts)
                if e.kind in (cl.EMPTY, cl.MALFORMED):
                    failures.append({"what": "your reply", "status": e.kind, "reason": e.reason})
                    continue
                break  # down, rate limited or refused after retries: the built-in explorer goes on
            entry["attempts"] = attempts
            try:
                try:
                    prop = parse_reply(text)
                except ParseError as e:
                    raise _Rejected("parse", str(e)) from None
                acc = self._check(prop, ctx, plan, tried, entry, describer)
            except _Rejected as r:
                entry.update(stage=r.stage, status=r.status, reason=r.reason)
                what = entry.get("what", "your reply")
                failures.append({"what": what, "status": f"{r.status} at {r.stage}",
                                 "reason": r.reason})  # fmt: skip
                continue
            entry.update(stage="accepted", status="accepted", mechanism=acc.mechanism,
                         params=acc.params, note=acc.note)  # fmt: skip
            if acc.module is not None:
                entry["module"] = acc.module.to_json()
            tried.add(canonical(acc.mechanism, acc.params))
            out.accepted.append((acc, entry))

    def _check(self, prop: Proposal, ctx: Context, plan: Plan, tried: set[str],
               entry: dict[str, Any], describer: Describer) -> _Accepted:  # fmt: skip
        if prop.kind == PARAMS:
            entry["what"] = f"{prop.mechanism} {prop.params}"
            return self._check_params(prop, ctx, plan, tried)
        assert self.acfg is not None
        sha = sha256(prop.source)
        entry.update(sha=sha, what=f"module agent_{sha[:16]}")
        if sha in self.modules:  # the same source again: its first mechanism, new params
            known = self.modules[sha].mechanisms[0]
            return self._check_params(Proposal(PARAMS, known["id"], prop.params), ctx, plan, tried)
        try:
            infos = check_source(prop.source, self._taken(), self.acfg.unsafe_skip_static_check)
        except StaticReject as e:
            write_source(self.root, prop.source, rejected=True)
            raise _Rejected("static", str(e)) from None
        m = write_source(self.root, prop.source)
        m.origin = {"model": self.acfg.model, "endpoint": self.acfg.endpoint,
                    "run_id": self.run_id, "round": None, "agent": entry["agent"]}  # fmt: skip
        got = describer.describe(m)
        if not got.ok:
            raise _Rejected("describe", got.reason, got.status)
        if [(d["id"], d["factor"]) for d in got.mechanisms] != [(x.id, x.factor) for x in infos]:
            raise _Rejected("describe", "the ids/factors it reports at run time differ from the "
                            "literals in its source")  # fmt: skip
        first = got.mechanisms[0]
        if first.get("applicable") is not None:
            raise _Rejected("describe", f"{first['id']} does not apply: {first['applicable']}")
        try:
            space = params_of(first["space"])
            params = check_params(space, prop.params, f"mechanism {first['id']}")
        except (ConfigError, TypeError, ValueError) as e:
            raise _Rejected("describe", f"bad space or params: {e}") from None
        m.mechanisms = got.mechanisms
        return _Accepted(first["id"], params, m, prop.note)

    def _check_params(self, prop: Proposal, ctx: Context, plan: Plan, tried: set[str]
                      ) -> _Accepted:  # fmt: skip
        mech = self.mechs.get(prop.mechanism)
        if mech is None:
            raise _Rejected("params", f"unknown mechanism {prop.mechanism!r}; known: "
                            f"{sorted(self.mechs)}")  # fmt: skip
        why = mech.applicable(ctx, plan)
        if why is not None:
            raise _Rejected("params", f"{mech.id} does not apply to the plan: {why}")
        try:
            params = pilot_steps.check_params(mech, ctx, plan, prop.params)
            new = pilot_steps.apply_steps(plan, [(mech.id, params)], self.mechs, lambda _: ctx)
        except (ConfigError, TypeError, ValueError) as e:
            raise _Rejected("params", str(e)) from None
        if canonical(mech.id, params) in tried:
            raise _Rejected("params", f"{mech.id} {params} was already tried on this plan")
        strip = ("mechanisms",)
        if {k: v for k, v in new.to_json().items() if k not in strip} == {
            k: v for k, v in plan.to_json().items() if k not in strip
        }:
            raise _Rejected("params", f"{mech.id} {params} does not change the plan")
        return _Accepted(mech.id, params, None, prop.note)

    def after_round(self, rnd: int, items: Sequence[Item], results: Mapping[str, TrialResult],
                    kept: Sequence[Change]) -> list[dict[str, Any]]:  # fmt: skip
        """Feed trial outcomes back to the agents; store kept agent modules in the memory.
        Returns log entries for the round's record."""
        out: list[dict[str, Any]] = []
        for it in items:
            if it.source != "agent":
                continue
            res = results.get(it.key)
            status = res.status if res is not None else "NOT RUN"
            speedup = res.speedup if res is not None else None
            if status != "PASS" or not speedup or speedup <= 1 + self.cfg.min_gain:
                why = (res.reason if res is not None else "") or (
                    f"PASS but not faster (speedup {speedup})"
                )
                failures = self.failures.setdefault(int(it.agent or 0), [])
                failures.append({"what": f"{it.mechanism} {it.params}", "status": status,
                                 "reason": why})  # fmt: skip
        for k in kept:
            m = self.by_id.get(k.mechanism)
            if m is None:
                continue
            source = (Path(m.directory) / f"{m.module}.py").read_text()
            origin = {"run_id": self.run_id, **m.origin}  # a reused module keeps its own
            origin["round"] = rnd if origin.get("round") is None else origin["round"]
            if self.memory.add_agent_source(source, [x["id"] for x in m.mechanisms], origin):
                out.append({"stage": "stored", "status": "stored", "sha": m.sha,
                            "mechanism": k.mechanism, "origin": origin})  # fmt: skip
        return out


def agent_explorer(setup: ExplorerSetup) -> AgentExplorer | None:
    """The :data:`specpilot.pilot.explorer.ExplorerFactory` of the agents: None when there is
    nothing agent-written to run (see :meth:`AgentExplorer.start`)."""
    return AgentExplorer.start(setup.cfg, setup.out, setup.run_id, setup.memory, setup.mechs,
                               setup.ctx_of, setup.log, setup.records, setup.plan)  # fmt: skip
