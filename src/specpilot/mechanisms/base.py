"""The ``Mechanism`` protocol: one candidate optimization the pilot loop can try.

A mechanism targets one factor of the cost model (``tau``, ``kernel`` or ``overhead``), declares a
typed parameter space, says whether it applies to a context (device, dtype, architecture,
drafter, batch size) and plan, and turns a plan plus parameter values into a new plan. It never
times or verifies anything itself: the trusted harness builds the new plan in a trial
subprocess, token-forces it against the reference on held-back prompts, and only then times it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from specpilot.errors import ConfigError
from specpilot.plan import Plan

FACTORS = ("tau", "kernel", "overhead")
PARAM_KINDS = ("int", "float", "categorical", "bool")


@dataclass(frozen=True)
class Param:
    """One dimension of a mechanism's parameter space (maps onto an Optuna distribution)."""

    name: str
    kind: str
    """"int", "float" (``low``..``high``, ``log`` scale optional), "categorical" (``choices``),
    "bool"."""
    default: Any
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] = ()
    log: bool = False

    def __post_init__(self) -> None:
        if self.kind not in PARAM_KINDS:
            raise ConfigError(f"param {self.name}: kind must be one of {PARAM_KINDS}")
        numeric = self.kind in ("int", "float")
        if numeric and (self.low is None or self.high is None or self.low > self.high):
            raise ConfigError(f"param {self.name}: needs low <= high")
        if self.kind == "categorical" and not self.choices:
            raise ConfigError(f"param {self.name}: a categorical param needs choices")

    def check(self, value: Any) -> Any:
        """``value`` validated (and coerced for numbers); ConfigError when out of the space."""
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"param {self.name}: expected true/false, got {value!r}")
            return value
        if self.kind == "categorical":
            if value not in self.choices:
                raise ConfigError(f"param {self.name}: {value!r} not in {list(self.choices)}")
            return value
        try:
            v = int(value) if self.kind == "int" else float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"param {self.name}: expected a number, got {value!r}") from None
        assert self.low is not None and self.high is not None
        if not self.low <= v <= self.high:
            raise ConfigError(f"param {self.name}: {v} outside [{self.low}, {self.high}]")
        return v


@dataclass(frozen=True)
class Context:
    """Where a plan runs: what memory entries are keyed and compared by."""

    arch: str
    """Model architecture (llama, mistral, qwen2, qwen3)."""
    params_m: float
    """Target size in millions of parameters."""
    drafter_kind: str
    device: str
    """Device kind: "cpu" or a GPU name (e.g. "NVIDIA H200")."""
    dtype: str
    batch_size: int = 1
    threads: int = 0
    """CPU threads available (0 = not a CPU context)."""


@runtime_checkable
class Mechanism(Protocol):
    id: str
    """Stable identifier, stored in plans and memory (e.g. "chain_length")."""
    description: str
    factor: str
    """The factor it targets: one of :data:`FACTORS`."""

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        """Its typed parameter space for this context and plan."""

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        """None when it applies; otherwise the reason it does not (shown in the round log)."""

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        """The plan with this mechanism applied (params already validated against ``space``)."""
