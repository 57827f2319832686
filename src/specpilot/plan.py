"""Plans: everything that decides how the engine decodes, as one JSON document.

A :class:`Plan` names the drafter (and its options), the draft-tree shape (:class:`TreeSpec`), the
engine's runtime choices (:class:`EngineConfig`), free-form runtime ``options`` that mechanisms
switch on, and the list of mechanisms (with their parameters) that produced it. ``specpilot
optimize`` writes ``DIR/plan.json``; ``generate``, ``bench``, ``profile`` and ``serve`` read it
with ``--plan``. Files are validated on load (unknown keys, bad values -> :class:`ConfigError`)
and written atomically.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from specpilot.engine import EngineConfig
from specpilot.errors import ConfigError
from specpilot.tree import TreeSpec

PLAN_VERSION = 1


@dataclass(frozen=True)
class AppliedMechanism:
    """One mechanism applied to a plan, with the parameters it was applied with."""

    id: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """How to decode: drafter, tree shape, engine choices, mechanism options and provenance."""

    drafter: str = "suffix"
    """Drafter name (see :data:`specpilot.drafters.DRAFTERS`) or a trained drafter directory."""
    drafter_options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword options for the drafter's constructor (e.g. lookup ``min_n``/``max_n``)."""
    tree: TreeSpec = field(default_factory=lambda: TreeSpec(kind="chain", k=5))
    engine: EngineConfig = field(default_factory=EngineConfig)
    options: Mapping[str, Any] = field(default_factory=dict)
    """Runtime switches owned by mechanisms, keyed by mechanism id (read when the plan is built)."""
    mechanisms: tuple[AppliedMechanism, ...] = ()
    """Mechanisms applied, in order (provenance; the fields above already hold their effect)."""

    def replace(self, **changes: Any) -> Plan:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        d = {
            "version": PLAN_VERSION,
            "drafter": self.drafter,
            "drafter_options": dict(self.drafter_options),
            "tree": asdict(self.tree),
            "engine": asdict(self.engine),
            "options": {k: _plain(v) for k, v in self.options.items()},
            "mechanisms": [{"id": m.id, "params": dict(m.params)} for m in self.mechanisms],
        }
        d["tree"]["paths"] = [list(p) for p in self.tree.paths]
        return d

    @classmethod
    def from_json(cls, d: Any, where: str = "plan") -> Plan:
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(d).__name__}")
        known = {"version", "drafter", "drafter_options", "tree", "engine", "options", "mechanisms"}
        extra = sorted(set(d) - known)
        if extra:
            raise ConfigError(f"{where}: unknown key(s) {extra}; known: {sorted(known)}")
        version = d.get("version", PLAN_VERSION)
        if version != PLAN_VERSION:
            raise ConfigError(f"{where}: plan version {version!r}, this specpilot reads version 1")
        drafter = d.get("drafter", "suffix")
        if not isinstance(drafter, str) or not drafter:
            raise ConfigError(f"{where}: 'drafter' must be a non-empty string")
        tree = dict(_obj(d.get("tree", {}), f"{where}: tree"))
        if "paths" in tree:
            try:
                tree["paths"] = tuple(tuple(int(r) for r in p) for p in tree["paths"])
            except (TypeError, ValueError):
                raise ConfigError(
                    f"{where}: tree: 'paths' must be a list of lists of integer ranks"
                ) from None
        engine = _obj(d.get("engine", {}), f"{where}: engine")
        mechs = d.get("mechanisms", [])
        if not isinstance(mechs, list):
            raise ConfigError(f"{where}: 'mechanisms' must be a list")
        applied = []
        for i, m in enumerate(mechs):
            m = _obj(m, f"{where}: mechanisms[{i}]")
            if not isinstance(m.get("id"), str):
                raise ConfigError(f"{where}: mechanisms[{i}] needs a string 'id'")
            applied.append(AppliedMechanism(m["id"], dict(_obj(m.get("params", {}), "params"))))
        return cls(
            drafter=drafter,
            drafter_options=dict(_obj(d.get("drafter_options", {}), f"{where}: drafter_options")),
            tree=_dataclass(TreeSpec, tree, f"{where}: tree"),
            engine=_dataclass(EngineConfig, engine, f"{where}: engine"),
            options=dict(_obj(d.get("options", {}), f"{where}: options")),
            mechanisms=tuple(applied),
        )

    def describe(self) -> str:
        """One line for tables and logs, e.g. ``suffix/chain k=5``."""
        t = self.tree
        shape = {
            "chain": f"chain k={t.k}",
            "static": f"static {len(t.paths)} nodes",
            "dynamic": f"dynamic N={t.budget} topk={t.topk} depth={t.depth}",
        }[t.kind]
        label = f"{self.drafter}/{shape}" if self.drafter != "none" else "AR (no drafter)"
        numerics = self.engine.numerics
        return label if numerics == "fp32" else f"{label} [{numerics} numerics]"


def _obj(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(v).__name__}")
    return v


def _dataclass(cls: type, d: dict[str, Any], where: str) -> Any:
    names = {f.name for f in fields(cls)}
    extra = sorted(set(d) - names)
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {extra}; known: {sorted(names)}")
    for f in fields(cls):  # JSON types first: a string where a number goes is a clear error
        want = _SCALARS.get(str(f.type))
        v = d.get(f.name)
        if want is not None and f.name in d and v is not None and not _is(v, want[0]):
            raise ConfigError(f"{where}: {f.name!r} must be {want[1]}, got {v!r}")
    try:
        return cls(**d)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None
    except ConfigError as e:  # "--threads must ..." from the dataclass: name the plan's field
        msg = re.sub(r"--([a-z][a-z-]*)", lambda m: repr(m.group(1).replace("-", "_")), str(e))
        raise ConfigError(f"{where}: {msg}") from None


_SCALARS = {
    "int": (int, "an integer"),
    "int | None": (int, "an integer or null"),
    "float": (float, "a number"),
    "float | None": (float, "a number or null"),
    "bool": (bool, "true or false"),
    "str": (str, "a string"),
}
"""Annotation -> (JSON type, its name) of the plan's scalar dataclass fields."""


def _is(v: Any, want: type) -> bool:
    if want is bool or isinstance(v, bool):
        return want is bool and isinstance(v, bool)
    return isinstance(v, (int, float)) if want is float else isinstance(v, want)


def _plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file (``plan.json`` or any JSON plan)."""
    p = Path(path)
    if p.is_dir():
        p = p / "plan.json"
    if not p.is_file():
        raise ConfigError(f"--plan: no plan file at {p}")
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--plan: {p} is not a readable JSON plan: {e}") from None
    return Plan.from_json(d, where=str(p))


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write ``plan`` as JSON atomically (a temp file in the same directory, then rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".plan-", suffix=".json", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(plan.to_json(), f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
