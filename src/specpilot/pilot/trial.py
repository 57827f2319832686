"""One trial: token-force a candidate plan, then time it against the current plan (trusted side).

Protocol of :func:`run_trial` (the parent; the child is :mod:`.child`):
  1. start the candidate child: it loads the model, applies the mechanism steps to the base plan,
     builds and warms up; it is kept stopped (SIGSTOP) whenever it is not serving a request;
  2. **forcing**: send the held-back prompts one at a time and compare every output token by
     token with the trusted reference (:func:`specpilot.forcing.check`, strict). The first
     divergence ends the trial: MISMATCH, no speed figure;
  3. **timing** (only after forcing passed): start the baseline child (the current plan), then
     under the exclusive timing slot, for each round, alternate baseline and candidate on each of
     the round's tuning prompts (the order flips every prompt). The parent takes the wall clock
     around each request/response itself; every timed output is compared with the reference
     too. No prompt is sent twice to one child, so outputs cached between requests never help;
     per round, speedup = baseline seconds / candidate seconds (same tokens, both lossless);
     the result is the median over rounds and the spread half their range.
Every outcome is a :class:`TrialResult` with status PASS / MISMATCH / TIMEOUT / CRASH /
INTERRUPTED and a reason; nothing is raised across the process boundary, and both children's
trees are killed at the end whatever happened. INTERRUPTED: the run was asked to stop (the first
SIGINT sets the ``abort`` event) while the trial was in flight; it says nothing about the
candidate, and ``--resume`` runs the trial again.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import monotonic as _monotonic
from time import perf_counter as _clock
from typing import Any

from specpilot.errors import ConfigError
from specpilot.forcing import Reference, check
from specpilot.pilot.proc import (
    Abort,
    ChildGone,
    ChildInterrupted,
    ChildProcess,
    ChildTimeout,
    ProtocolError,
    TimingSlot,
)

PASS, MISMATCH, TIMEOUT, CRASH = "PASS", "MISMATCH", "TIMEOUT", "CRASH"
INTERRUPTED = "INTERRUPTED"
STATUSES = (PASS, MISMATCH, TIMEOUT, CRASH, INTERRUPTED)
INTERRUPTED_REASON = "interrupted (SIGINT) in {phase}; --resume runs it again"


@dataclass(frozen=True)
class TrialLimits:
    """Limits of one trial's children (the parent enforces them)."""

    setup_timeout_s: float = 300.0
    """Loading, applying, building and warming up one child."""
    request_timeout_s: float = 120.0
    """One request (one prompt decoded, or one profile)."""
    trial_timeout_s: float = 1200.0
    """Child time of the whole trial (setup and requests; waiting for the slot not counted)."""
    memory_bytes: int = 8 << 30
    """Address-space limit of each child (RLIMIT_AS); 0 = none (needed on CUDA)."""
    threads: int = 0
    """torch threads in each child before the plan's own setting (0 = torch's default)."""

    def __post_init__(self) -> None:
        for name in ("setup_timeout_s", "request_timeout_s", "trial_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.memory_bytes < 0 or self.threads < 0:
            raise ConfigError("memory_bytes and threads must be >= 0")


@dataclass(frozen=True)
class PromptCase:
    """A prompt and its trusted reference output."""

    prompt_id: str
    ids: tuple[int, ...]
    reference: Reference


@dataclass(frozen=True)
class ChildSpec:
    """What a child builds: the model, a base plan (JSON) and mechanism steps to apply to it."""

    model: str
    plan: Mapping[str, Any]
    steps: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    modules: tuple[str, ...] = ()
    """Extra mechanism modules the child imports (each exposes ``MECHANISMS``)."""
    python_path: tuple[str, ...] = ()
    """Prepended to the child's PYTHONPATH (so ``modules`` can be found)."""
    sandbox: str = ""
    """The child's sandbox (:class:`specpilot.pilot.sandbox.SandboxSpec` JSON), applied before
    it imports anything untrusted; empty = none (no agent-written code runs in it)."""
    weights: str | None = None
    """``load_model``'s ``weights`` ("fp32" / "native"); None = its default."""


@dataclass(frozen=True)
class TrialJob:
    key: str
    """Idempotency key: the same key is the same trial (see :mod:`.journal`)."""
    candidate: ChildSpec
    baseline: ChildSpec | None
    """The current plan to time against; None = forcing only."""
    forcing: tuple[PromptCase, ...]
    timed: tuple[tuple[PromptCase, ...], ...]
    """Rounds of tuning prompts; no prompt appears twice."""
    max_new_tokens: int
    stop_on_eos: bool = True
    limits: TrialLimits = field(default_factory=TrialLimits)
    slot: str | None = None
    """Timing-slot lock file shared by every trial on this device (None: no sharing)."""
    work_dir: str = ""
    """Child logs go to ``work_dir/<key>/``; empty = a temporary directory."""
    warmup: tuple[int, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment of the children (e.g. ``CUDA_VISIBLE_DEVICES`` of the worker's GPU)."""


@dataclass
class TrialResult:
    key: str
    status: str
    reason: str = ""
    phase: str = ""
    """Where it ended: setup, forcing, baseline, timing, done."""
    plan: dict[str, Any] | None = None
    """The candidate's plan as the child built it (mechanisms applied)."""
    forcing: dict[str, Any] = field(default_factory=dict)
    """n_prompts, n_tokens, status, summary, near_ties, divergences (described)."""
    speedup: float | None = None
    """Median over rounds of baseline time / candidate time; None unless PASS with timing."""
    spread: float | None = None
    round_ratios: list[float] = field(default_factory=list)
    cand_tok_s: float | None = None
    base_tok_s: float | None = None
    tau: float | None = None
    """Child-reported tokens per target step during timing (display only, never decides)."""
    accept_hist: list[int] = field(default_factory=list)
    """Child-reported count of steps by accepted length (display only)."""
    base_tau: float | None = None
    base_accept_hist: list[int] = field(default_factory=list)
    """The same for the baseline (the current plan)."""
    setup_s: float | None = None
    base_setup_s: float | None = None
    """Untimed setup (load, apply, build, warm-up) of each child: a candidate whose setup is far
    longer than the baseline's may be precomputing outside the timed requests (shown, not
    judged: torch.compile and the like are legitimately slow to set up)."""
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        assert self.status in STATUSES, f"unknown trial status {self.status!r}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TrialResult:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class _Failure(Exception):
    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


class _Child:
    """A child plus the trial's time accounting."""

    def __init__(self, name: str, spec: ChildSpec, job: TrialJob, tmp: Path, logs: Path,
                 abort: Abort | None = None) -> None:  # fmt: skip
        self.name, self.job, self.abort = name, job, abort
        env = {**os.environ, **job.env}
        env["TMPDIR"] = str(tmp)
        if spec.python_path:
            env["PYTHONPATH"] = os.pathsep.join(
                [*spec.python_path, *filter(None, [env.get("PYTHONPATH")])]
            )
        args = ["--memory-bytes", str(job.limits.memory_bytes)]
        if job.limits.threads:
            args += ["--threads", str(job.limits.threads)]
        if spec.sandbox:
            args += ["--sandbox", spec.sandbox]
        self.proc = ChildProcess(args, logs / f"{name}.log", tmp, env)
        self.spec = spec

    def call(self, msg: dict[str, Any], timeout: float, used: list[float]) -> tuple[dict, float]:
        """One request with the child running only during it; returns (answer, seconds)."""
        left = self.job.limits.trial_timeout_s - used[0]
        if left <= 0:
            raise _Failure(TIMEOUT, f"{self.name}: trial time limit used up")
        limit = min(timeout, left)
        t0 = _clock()
        self.proc.cont()
        try:
            ans = self.proc.request(msg, _monotonic() + limit, self.abort)
        except ChildInterrupted:
            raise _Failure(INTERRUPTED, f"{self.name}: {msg['op']} interrupted") from None
        except ChildTimeout:
            raise _Failure(
                TIMEOUT, f"{self.name}: no answer to {msg['op']} within {limit:.0f} s"
            ) from None
        except ChildGone:
            raise _Failure(CRASH, f"{self.name}: {self._death()}") from None
        except ProtocolError as e:
            raise _Failure(CRASH, f"{self.name}: protocol violation: {e}") from None
        finally:
            t1 = _clock()
            self.proc.stop()
            used[0] += t1 - t0
        if ans["op"] == "error":
            raise _Failure(CRASH, f"{self.name}: {_describe_error(ans, self.job.limits)}")
        return ans, t1 - t0

    def _death(self) -> str:
        try:
            rc = self.proc.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
        tail = self.proc.log_tail(600).strip().replace("\n", " | ")
        if rc is not None and rc < 0:
            name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else -rc
            what = f"killed by {name}"
        else:
            what = f"exited with code {rc}" if rc is not None else "closed its pipe"
        return what + (f"; log: ...{tail[-400:]}" if tail else "")

    def kill(self) -> None:
        self.proc.kill()


def _describe_error(ans: Mapping[str, Any], limits: TrialLimits) -> str:
    kind, msg = str(ans.get("type", "Error")), str(ans.get("message", ""))
    oom = kind == "MemoryError" or "can't allocate memory" in msg or "out of memory" in msg
    where = ans.get("where", "?")
    if oom:
        lim = f"{limits.memory_bytes / (1 << 30):.1f} GiB" if limits.memory_bytes else "none"
        return f"out of memory in {where} (address-space limit {lim}): {kind}: {msg[:300]}"
    return f"{where} failed: {kind}: {msg[:500]}"


def _tokens(ans: Mapping[str, Any], who: str) -> list[int]:
    toks = ans.get("tokens")
    if ans.get("op") != "tokens" or not isinstance(toks, list):
        raise _Failure(CRASH, f"{who}: protocol violation: expected tokens, got {ans.get('op')}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise _Failure(CRASH, f"{who}: protocol violation: non-integer token ids")
    return toks


def _setup_msg(spec: ChildSpec, job: TrialJob) -> dict[str, Any]:
    return {
        "op": "setup",
        "model": spec.model,
        "plan": dict(spec.plan),
        "steps": [[mid, dict(p)] for mid, p in spec.steps],
        "modules": list(spec.modules),
        "weights": spec.weights,
        "max_new_tokens": job.max_new_tokens,
        "stop_on_eos": job.stop_on_eos,
        "warmup": list(job.warmup),
    }


def run_trial(job: TrialJob, abort: Abort | None = None) -> TrialResult:
    """Run ``job``; always returns a result (harness bugs too are a CRASH with the traceback).
    Once ``abort`` is set the children are killed and the result is INTERRUPTED."""
    start = _clock()
    res = TrialResult(job.key, PASS, phase="setup")
    tmp = Path(tempfile.mkdtemp(prefix="specpilot-trial-"))
    logs = Path(job.work_dir) / _safe(job.key) if job.work_dir else tmp
    children: list[_Child] = []
    try:
        logs.mkdir(parents=True, exist_ok=True)
        _run(job, res, tmp, logs, children, abort)
        res.phase = "done"
    except _Failure as f:
        res.status, res.reason = f.status, f.reason
        if f.status == INTERRUPTED:
            res.reason = INTERRUPTED_REASON.format(phase=res.phase)
    except Exception as e:  # a harness bug must not break the pool either
        res.status = CRASH
        res.reason = f"harness error: {type(e).__name__}: {e}; " + traceback.format_exc()[-800:]
    finally:
        for c in children:
            c.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    if res.status != PASS:
        res.speedup = res.spread = None
    res.duration_s = _clock() - start
    return res


def _run(job: TrialJob, res: TrialResult, tmp: Path, logs: Path, children: list[_Child],
         abort: Abort | None) -> None:  # fmt: skip
    slot = TimingSlot(job.slot)
    lim = job.limits
    used = [0.0]
    with slot.shared():
        cand = _Child("candidate", job.candidate, job, tmp, logs, abort)
        children.append(cand)
        ready, res.setup_s = cand.call(_setup_msg(job.candidate, job), lim.setup_timeout_s, used)
    res.plan = _checked_plan(ready)

    res.phase = "forcing"
    outs: dict[str, list[int]] = {}
    refs = [c.reference for c in job.forcing]
    for case in job.forcing:
        with slot.shared():
            ans, _ = cand.call(
                {"op": "generate", "ids": list(case.ids)}, lim.request_timeout_s, used
            )
        outs[case.prompt_id] = _tokens(ans, "candidate")
        one = check([case.reference], {case.prompt_id: outs[case.prompt_id]}, strict=True)
        if not one.ok:
            partial = check(refs[: len(outs)], outs, strict=True)
            res.forcing = _forcing_json(partial)
            raise _Failure(MISMATCH, f"forcing: {one.summary()}")
    report = check(refs, outs, strict=True)
    res.forcing = _forcing_json(report)
    if job.baseline is None or not job.timed:
        return

    res.phase = "baseline"
    with slot.shared():
        base = _Child("baseline", job.baseline, job, tmp, logs, abort)
        children.append(base)
        _, res.base_setup_s = base.call(_setup_msg(job.baseline, job), lim.setup_timeout_s, used)
        for c in (base, cand):
            c.call({"op": "reset"}, lim.request_timeout_s, used)

    res.phase = "timing"
    ratios: list[float] = []
    tot = {"baseline": [0, 0.0], "candidate": [0, 0.0]}
    steps = {"baseline": 0, "candidate": 0}
    accept: dict[str, list[int]] = {"baseline": [], "candidate": []}
    seen: set[str] = set()
    with slot.exclusive():
        for r, rnd in enumerate(job.timed):
            secs = {"baseline": 0.0, "candidate": 0.0}
            for j, case in enumerate(rnd):
                assert case.prompt_id not in seen, f"timed prompt {case.prompt_id} repeated"
                seen.add(case.prompt_id)
                order = (base, cand) if (r + j) % 2 == 0 else (cand, base)
                for child in order:
                    msg = {"op": "generate", "ids": list(case.ids)}
                    ans, s = child.call(msg, lim.request_timeout_s, used)
                    toks = _tokens(ans, child.name)
                    rep = check([case.reference], {case.prompt_id: toks}, strict=True)
                    if not rep.ok:
                        status = MISMATCH if child is cand else CRASH
                        raise _Failure(status, f"{child.name} in timing: {rep.summary()}")
                    secs[child.name] += s
                    tot[child.name][0] += len(toks)
                    tot[child.name][1] += s
                    steps[child.name] += _int(ans.get("steps"))
                    accept[child.name].extend(_int(a) for a in ans.get("accept") or [])
            if secs["candidate"] > 0:
                ratios.append(secs["baseline"] / secs["candidate"])
    res.round_ratios = ratios
    res.speedup = statistics.median(ratios) if ratios else None
    res.spread = (max(ratios) - min(ratios)) / 2 if len(ratios) > 1 else 0.0
    res.cand_tok_s = tot["candidate"][0] / tot["candidate"][1] if tot["candidate"][1] else None
    res.base_tok_s = tot["baseline"][0] / tot["baseline"][1] if tot["baseline"][1] else None
    res.tau, res.accept_hist = _tau(steps["candidate"], accept["candidate"])
    res.base_tau, res.base_accept_hist = _tau(steps["baseline"], accept["baseline"])


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 20 else 0


def _tau(steps: int, accept: list[int]) -> tuple[float | None, list[int]]:
    """(tokens per step, steps by accepted length) from child-reported stats; display only."""
    if steps <= 0:
        return None, []
    hist = [0] * (min(max(accept, default=0), 256) + 1)
    for a in accept:
        hist[min(a, 256)] += 1
    return (sum(accept) + steps) / steps, hist


def _checked_plan(ready: Mapping[str, Any]) -> dict[str, Any]:
    from specpilot.plan import Plan

    if ready.get("op") != "ready":
        raise _Failure(CRASH, f"candidate: protocol violation: expected ready, got {ready['op']}")
    try:
        return Plan.from_json(ready.get("plan"), where="candidate plan").to_json()
    except ConfigError as e:
        raise _Failure(CRASH, f"candidate returned an invalid plan: {e}") from None


def _forcing_json(rep: Any) -> dict[str, Any]:
    return {
        "status": rep.status,
        "n_prompts": rep.n_prompts,
        "n_tokens": rep.n_tokens,
        "near_ties": rep.near_ties,
        "summary": rep.summary(),
        "divergences": [d.describe() for d in rep.divergences[:10]],
    }


def _safe(key: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in key)[:120]


@dataclass(frozen=True)
class ProfileJob:
    """Phase 0 in a child: the cost model of one plan on tuning prompts."""

    key: str
    child: ChildSpec
    prompts: tuple[tuple[str, tuple[int, ...]], ...]
    config: Mapping[str, Any]
    """:class:`specpilot.costmodel.ProfileConfig` fields."""
    max_new_tokens: int
    stop_on_eos: bool = True
    limits: TrialLimits = field(default_factory=TrialLimits)
    slot: str | None = None
    work_dir: str = ""
    warmup: tuple[int, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    compare_drafters: bool = True
    """Replay the context's other drafters too: the tau factor then sees a better drafter."""


def run_profile(
    job: ProfileJob, abort: Abort | None = None
) -> tuple[str, str, dict[str, Any] | None]:
    """(status, reason, CostReport JSON or None); the profile times, so it holds the slot
    exclusively. Never raises; INTERRUPTED once ``abort`` is set."""
    tmp = Path(tempfile.mkdtemp(prefix="specpilot-profile-"))
    logs = Path(job.work_dir) / _safe(job.key) if job.work_dir else tmp
    as_trial = TrialJob(
        job.key, job.child, None, (), (), job.max_new_tokens, job.stop_on_eos, job.limits,
        job.slot, job.work_dir, job.warmup, job.env,
    )  # fmt: skip
    child = None
    try:
        logs.mkdir(parents=True, exist_ok=True)
        used = [0.0]
        slot = TimingSlot(job.slot)
        with slot.shared():
            child = _Child("profile", job.child, as_trial, tmp, logs, abort)
            child.call(_setup_msg(job.child, as_trial), job.limits.setup_timeout_s, used)
        msg = {
            "op": "profile",
            "prompts": [[pid, list(ids)] for pid, ids in job.prompts],
            "config": dict(job.config),
            "compare_drafters": job.compare_drafters,
        }
        with slot.exclusive():
            ans, _ = child.call(msg, job.limits.trial_timeout_s, used)
        rep = ans.get("report")
        if ans.get("op") != "report" or not isinstance(rep, dict):
            return CRASH, "profile: protocol violation", None
        return PASS, "", rep
    except _Failure as f:
        if f.status == INTERRUPTED:
            return INTERRUPTED, INTERRUPTED_REASON.format(phase="profile"), None
        return f.status, f.reason, None
    except Exception as e:
        return CRASH, f"harness error: {type(e).__name__}: {e}", None
    finally:
        if child is not None:
            child.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def prompt_cases(
    prompts: Sequence[tuple[str, Sequence[int]]], refs: Mapping[str, Reference]
) -> tuple[PromptCase, ...]:
    return tuple(PromptCase(pid, tuple(ids), refs[pid]) for pid, ids in prompts)
