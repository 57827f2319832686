"""The mechanisms the pilot knows, and applying them to a plan as steps.

* :func:`all_mechanisms`: :func:`specpilot.mechanisms.all_mechanisms` plus any extra modules
  named on the command line or by a test (each such module exposes ``MECHANISMS``: a sequence of
  objects satisfying the :class:`~specpilot.mechanisms.base.Mechanism` protocol). Extra modules
  win on a shared id.
* :func:`apply_steps`: mechanisms applied in order (applicability, params checked against the
  space, provenance recorded in ``plan.mechanisms``).
* :func:`registry_part`: a plan without what only extra modules define (the part
  :func:`specpilot.runtime.build` knows; the rest is their ``wrap_decode`` hook).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specpilot import mechanisms as registry
from specpilot.errors import ConfigError
from specpilot.mechanisms.base import FACTORS, Context, Mechanism, Param
from specpilot.plan import AppliedMechanism, Plan


def all_mechanisms(modules: Sequence[str] = (), use_registry: bool = True) -> dict[str, Mechanism]:
    """Every known mechanism by id: the package's registry (unless ``use_registry`` is False),
    then ``modules`` (which override). ConfigError (one line) for a module that cannot be
    imported or has no ``MECHANISMS``."""
    found: dict[str, Mechanism] = {}
    if use_registry:
        found = {m.id: m for m in registry.all_mechanisms()}
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"--mechanisms: cannot import module {name!r}: {e}") from None
        except Exception as e:  # a module that fails while importing is the user's error too
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            raise ConfigError(f"--mechanisms: importing module {name!r} failed: {why}") from None
        ms = getattr(mod, "MECHANISMS", None)
        if ms is None:
            raise ConfigError(f"--mechanisms: module {name!r} has no MECHANISMS sequence")
        for m in ms:
            found[m.id] = m
    for m in found.values():
        if m.factor not in FACTORS:
            raise ConfigError(f"mechanism {m.id}: factor {m.factor!r} is not one of {FACTORS}")
    return found


def registered_ids() -> set[str]:
    return {m.id for m in registry.all_mechanisms()}


def check_params(mech: Mechanism, ctx: Context, plan: Plan, params: Mapping[str, Any]) -> dict:
    """``params`` validated against the mechanism's space (unknown or missing names fail)."""
    space: dict[str, Param] = {p.name: p for p in mech.space(ctx, plan)}
    extra = sorted(set(params) - set(space))
    if extra:
        raise ConfigError(f"mechanism {mech.id}: unknown parameter(s) {extra}")
    return {name: p.check(params[name]) if name in params else p.default
            for name, p in space.items()}  # fmt: skip


def apply_steps(
    plan: Plan,
    steps: Sequence[tuple[str, Mapping[str, Any]]],
    mechanisms: Mapping[str, Mechanism],
    ctx_of: Callable[[Plan], Context],
) -> Plan:
    """Apply mechanisms in order: applicability, params checked against the space, provenance
    recorded in ``plan.mechanisms`` (a later application of the same id replaces the earlier)."""
    for mid, params in steps:
        mech = mechanisms.get(mid)
        if mech is None:
            raise ConfigError(f"unknown mechanism {mid!r}; known: {sorted(mechanisms)}")
        ctx = ctx_of(plan)
        why = mech.applicable(ctx, plan)
        if why is not None:
            raise ConfigError(f"mechanism {mid} does not apply: {why}")
        checked = check_params(mech, ctx, plan, params)
        new = mech.apply(plan, checked)
        if not isinstance(new, Plan):
            raise ConfigError(f"mechanism {mid}: apply returned {type(new).__name__}, not a Plan")
        kept = tuple(m for m in new.mechanisms if m.id != mid)
        plan = new.replace(mechanisms=(*kept, AppliedMechanism(mid, checked)))
    return plan


def registry_part(plan: Plan, extra: set[str]) -> Plan:
    """``plan`` without the provenance and options of mechanisms that only extra modules define
    (their effect is their ``wrap_decode`` hook, which the runtime does not know)."""
    if not extra:
        return plan
    return plan.replace(
        mechanisms=tuple(m for m in plan.mechanisms if m.id not in extra),
        options={k: v for k, v in plan.options.items() if k not in extra},
    )
