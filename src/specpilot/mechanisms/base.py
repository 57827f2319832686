"""The ``Mechanism`` protocol: one candidate optimization the pilot loop can try.

A mechanism targets one factor of the cost model (``tau``, ``kernel`` or ``overhead``), declares a
typed parameter space, says whether it applies to a context (device, dtype, architecture,
drafter, batch size) and plan, and turns a plan plus parameter values into a new plan. It never
times or verifies anything itself: the trusted harness builds the new plan in a trial
subprocess, token-forces it against the reference on held-back prompts, and only then times it.

A mechanism whose effect is not a plan field but something built at run time keeps a runtime
option in ``plan.options[id]`` and implements :class:`RuntimeMechanism`: ``parse_options``
validates the JSON entry, and ``configure(setup, options)`` applies it while
:func:`specpilot.runtime.build` builds the plan, through the models' public methods and the
:class:`RuntimeSetup` it is handed (every such mechanism the same way, in registry order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from specpilot.drafters.base import Drafter
from specpilot.errors import ConfigError
from specpilot.plan import Plan
from specpilot.tree import TreeSpec

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
    drafters: tuple[str, ...] = ("lookup", "suffix")
    """Drafters that can be built here: the training-free ones, plus "model" when a draft model
    is loaded and trained drafter directories when they exist."""
    vocab_size: int = 0
    """The target's vocabulary size (0 = unknown: an entry recorded before contexts had it)."""
    cpu_model: str = ""
    """The host CPU's model name (:func:`specpilot.machine.cpu_model`; "" = unknown)."""
    isa: str = ""
    """The host CPU's kernel ISA class (:func:`specpilot.machine.isa_level`; "" = unknown)."""
    weights: str = ""
    """How the target's weights run: "fp32" (dequantized) or "native" (GGUF blocks through the
    kernels); "" = unknown."""

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    @property
    def native(self) -> bool:
        """The target runs its GGUF blocks through the native kernels."""
        return self.weights == "native"


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


@dataclass
class RuntimeSetup:
    """What a mechanism's ``configure`` hook may change while a plan is built."""

    plan: Plan
    target: Any
    """The target :class:`specpilot.model.Transformer` (placed, prepacked as the plan says)."""
    draft: Any | None
    """The draft model's Transformer, or None without a draft model."""
    spec: TreeSpec
    """The tree the built plan verifies (a hook may cap it)."""
    batch_size: int
    base_drafter: Callable[[str, Mapping[str, Any]], Drafter | None]
    """Builds a registered drafter by name and options (e.g. a fallback drafter)."""
    wrappers: list[Callable[[Drafter], Drafter]] = field(default_factory=list)
    """Applied to every fresh drafter in order (outermost last)."""


@runtime_checkable
class RuntimeMechanism(Mechanism, Protocol):
    """A mechanism with a runtime option (see the module docstring)."""

    @staticmethod
    def parse_options(raw: Any) -> Any:
        """The validated options of ``plan.options[id]``; ConfigError on a bad entry."""

    def configure(self, setup: RuntimeSetup, options: Any) -> None:
        """Apply parsed ``options`` to the plan being built; ConfigError if it cannot be."""


def check_params(space: Sequence[Param], params: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``params`` validated against ``space``: unknown names rejected, missing ones defaulted."""
    names = {p.name for p in space}
    extra = sorted(set(params) - names)
    if extra:
        raise ConfigError(f"{where}: unknown param(s) {extra}; known: {sorted(names)}")
    return {p.name: p.check(params[p.name]) if p.name in params else p.default for p in space}


def defaults(space: Sequence[Param]) -> dict[str, Any]:
    return {p.name: p.default for p in space}


def apply_checked(
    mech: Mechanism, ctx: Context, plan: Plan, params: Mapping[str, Any] | None = None
) -> Plan:
    """Apply ``mech`` the safe way: applicability first, params checked against its space, the
    application recorded in ``plan.mechanisms`` (provenance). ConfigError with the reason when
    it does not apply or a param is out of its space."""
    reason = mech.applicable(ctx, plan)
    if reason is not None:
        raise ConfigError(f"mechanism {mech.id} does not apply here: {reason}")
    values = check_params(mech.space(ctx, plan), params or {}, f"mechanism {mech.id}")
    out = mech.apply(plan, values)
    return record(out, mech.id, values)


def record(plan: Plan, mech_id: str, params: Mapping[str, Any]) -> Plan:
    """``plan`` with ``(mech_id, params)`` appended to its provenance (an earlier application of
    the same mechanism is replaced: its effect was overwritten)."""
    from specpilot.plan import AppliedMechanism

    kept = tuple(m for m in plan.mechanisms if m.id != mech_id)
    return plan.replace(mechanisms=(*kept, AppliedMechanism(mech_id, dict(params))))


def with_option(plan: Plan, mech_id: str, value: Any) -> Plan:
    """``plan`` with ``options[mech_id] = value`` (None removes the entry)."""
    opts = {k: v for k, v in plan.options.items() if k != mech_id}
    if value is not None:
        opts[mech_id] = value
    return plan.replace(options=opts)


def optuna_distribution(p: Param) -> Any:
    """The Optuna distribution of one param (int/float ranges, categorical, bool as categorical)."""
    import optuna.distributions as od

    if p.kind == "int":
        assert p.low is not None and p.high is not None
        return od.IntDistribution(int(p.low), int(p.high), log=p.log)
    if p.kind == "float":
        assert p.low is not None and p.high is not None
        return od.FloatDistribution(float(p.low), float(p.high), log=p.log)
    if p.kind == "bool":
        return od.CategoricalDistribution((False, True))
    return od.CategoricalDistribution(tuple(p.choices))


def optuna_space(space: Sequence[Param]) -> dict[str, Any]:
    """``{name: distribution}`` for ``study.ask(fixed_distributions=...)`` (ask/tell)."""
    return {p.name: optuna_distribution(p) for p in space}


def parse_dataclass(cls: type, raw: Any, where: str) -> Any:
    """A frozen options dataclass from a JSON object: unknown keys and bad values -> ConfigError
    (the dataclass validates its own fields in ``__post_init__``)."""
    from dataclasses import fields

    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    names = {f.name for f in fields(cls)}
    extra = sorted(set(raw) - names)
    if extra:
        raise ConfigError(f"{where}: unknown key(s) {extra}; known: {sorted(names)}")
    try:
        return cls(**raw)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def require(ok: bool, where: str, what: str) -> None:
    """ConfigError ``where: what`` unless ``ok`` (for options dataclasses' ``__post_init__``)."""
    if not ok:
        raise ConfigError(f"{where}: {what}")


def no_drafter(plan: Plan) -> str | None:
    """The reason a drafting mechanism does not apply to a plain AR plan, else None."""
    return "the plan decodes without a drafter (plain AR)" if plan.drafter == "none" else None
