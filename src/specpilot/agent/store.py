"""Agent-written modules on the trusted side: written to the run's sandbox directory, described
by a sandboxed child, and stood in for by :class:`AgentMechanism` (never imported here).

``RUN_DIR/agent/src/agent_<sha16>.py`` holds one source that passed the static check (sha16: the
first 16 hex digits of its SHA-256); sandboxed children may read that directory and nothing
else of the run directory. The parent learns each mechanism's id, factor, description and
parameter space from ``describe`` requests to a sandboxed trial subprocess
(:mod:`specpilot.pilot.child`), one module per request (:class:`Describer`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import monotonic
from typing import Any

from specpilot.mechanisms.base import Context, Param, with_option
from specpilot.pilot.sandbox import SandboxSpec
from specpilot.plan import Plan

DESCRIBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class AgentMechanism:
    """The parent's stand-in for an agent-written mechanism (satisfies the Mechanism protocol).

    Its ``apply`` only marks the plan (``options[id]``) so the explorer's dry run sees a change;
    the real ``apply`` and ``wrap_decode`` run only inside sandboxed trial subprocesses, and the
    plan the coordinator keeps is always the one the child built."""

    id: str
    factor: str
    description: str
    params: tuple[Param, ...]
    module: str
    sha: str
    wraps_decode: bool = False

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return self.params

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return None  # decided in the child (a refusal there is a CRASH with its reason)

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return with_option(plan, self.id, {"agent_module": self.module, **dict(params)})


@dataclass
class AgentModule:
    """One written source and what its describe returned."""

    sha: str
    """SHA-256 of the source (hex)."""
    module: str
    directory: str
    mechanisms: list[dict[str, Any]] = field(default_factory=list)
    """Described: id, factor, description, space (Param fields), applicable, wraps_decode."""
    origin: dict[str, Any] = field(default_factory=dict)
    """Provenance: endpoint model, endpoint, run id, round, agent index."""

    def stand_ins(self) -> list[AgentMechanism]:
        return [
            AgentMechanism(
                m["id"],
                m["factor"],
                m["description"],
                params_of(m["space"]),
                self.module,
                self.sha,
                bool(m.get("wraps_decode")),
            )
            for m in self.mechanisms
        ]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def params_of(space: Sequence[Mapping[str, Any]]) -> tuple[Param, ...]:
    """Params from described JSON (ConfigError/TypeError/ValueError on a bad one)."""
    out = []
    for p in space:
        d = dict(p)
        d["choices"] = tuple(d.get("choices") or ())
        out.append(Param(**d))
    return tuple(out)


def sha256(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def write_source(root: Path, source: str, rejected: bool = False) -> AgentModule:
    """Write ``source`` (idempotent) to ``root/src`` (the directory sandboxed children may
    import from) or, for a source that failed the static check, ``root/rejected`` (kept for the
    record, never imported); the module is named after its hash."""
    sha = sha256(source)
    name = f"agent_{sha[:16]}"
    d = root / ("rejected" if rejected else "src")
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.py"
    if not path.exists() or sha256(path.read_text()) != sha:
        tmp = d / f".{name}.tmp"
        tmp.write_text(source)
        os.replace(tmp, path)
    return AgentModule(sha, name, str(d.resolve()))


def source_ok(m: AgentModule) -> bool:
    """The module file still holds the source its hash names (checked before reuse)."""
    path = Path(m.directory) / f"{m.module}.py"
    return path.is_file() and sha256(path.read_text()) == m.sha


@dataclass(frozen=True)
class DescribeOutcome:
    module: str
    ok: bool
    mechanisms: list[dict[str, Any]] = field(default_factory=list)
    status: str = ""
    """"", or TIMEOUT / CRASH (how describing it failed)."""
    reason: str = ""


class Describer:
    """Describes modules one request at a time in one sandboxed child (started on first use,
    replaced after a timeout or a crash, so a module that hangs or dies costs only itself).
    Every module lives in the one source directory the sandbox lets the child read."""

    def __init__(self, ctx: Context, plan: Mapping[str, Any], sandbox: SandboxSpec,
                 python_path: Sequence[str], log_dir: Path, memory_bytes: int,
                 timeout_s: float = DESCRIBE_TIMEOUT_S) -> None:  # fmt: skip
        self.ctx, self.plan, self.sandbox = asdict(ctx), dict(plan), sandbox
        self.python_path, self.log_dir = tuple(python_path), log_dir
        self.memory_bytes, self.timeout_s = memory_bytes, timeout_s
        self.child: Any = None
        self.scratch = ""

    def _start(self, directory: str) -> Any:
        from specpilot.pilot.proc import ChildProcess

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.scratch = tempfile.mkdtemp(prefix="specpilot-describe-")
        path = [*self.python_path, directory, *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "TMPDIR": self.scratch, "PYTHONPATH": os.pathsep.join(path)}
        args = ["--memory-bytes", str(self.memory_bytes), "--sandbox", self.sandbox.to_arg()]
        return ChildProcess(args, self.log_dir / "describe.log", Path(self.scratch), env)

    def describe(self, m: AgentModule) -> DescribeOutcome:
        from specpilot.pilot.proc import ChildGone, ChildTimeout, ProtocolError

        if self.child is None:
            self.child = self._start(m.directory)
        msg = {"op": "describe", "module": m.module, "ctx": self.ctx, "plan": self.plan}
        try:
            ans = self.child.request(msg, monotonic() + self.timeout_s)
        except ChildTimeout:
            self.close()
            why = f"describe: no answer within {self.timeout_s:.0f} s"
            return DescribeOutcome(m.module, False, status="TIMEOUT", reason=why)
        except (ChildGone, ProtocolError) as e:
            tail = self.child.log_tail(300).strip().replace("\n", " | ")
            self.close()
            return DescribeOutcome(m.module, False, status="CRASH",
                                   reason=f"describe: {e}; log: ...{tail[-300:]}")  # fmt: skip
        if ans.get("op") == "described" and isinstance(ans.get("mechanisms"), list):
            return DescribeOutcome(m.module, True, list(ans["mechanisms"]))
        why = f"{ans.get('type', 'Error')}: {str(ans.get('message', ''))[:400]}"
        return DescribeOutcome(m.module, False, status="CRASH",
                               reason=f"importing or describing failed: {why}")  # fmt: skip

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.child = None
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = ""
