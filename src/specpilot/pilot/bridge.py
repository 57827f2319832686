"""How the pilot finds mechanisms and turns a plan into something that decodes.

* Mechanisms come from :func:`specpilot.mechanisms.all_mechanisms` plus any extra modules named
  on the command line or by a test (each such module exposes ``MECHANISMS``: a sequence of
  objects satisfying the :class:`~specpilot.mechanisms.base.Mechanism` protocol). Extra modules
  win on a shared id.
* :func:`build_decoder` builds a plan with :func:`specpilot.runtime.build` and returns one
  function, ``decode(prompt_ids, GenerationConfig) -> GenerationResult``, with a fresh drafter
  per call's owner. A mechanism may define the optional ``wrap_decode(decode, params)``: it is
  called only here, inside the untrusted trial subprocess, never in the trusted parent.
* :func:`context_of` describes where a plan runs (the memory's key).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specpilot.errors import ConfigError
from specpilot.mechanisms.base import FACTORS, Context, Mechanism, Param
from specpilot.plan import AppliedMechanism, Plan

Decode = Callable[[list[int], Any], Any]
"""``decode(prompt_ids, GenerationConfig) -> GenerationResult``."""


def all_mechanisms(modules: Sequence[str] = (), registry: bool = True) -> dict[str, Mechanism]:
    """Every known mechanism by id: the package's registry (unless ``registry`` is False), then
    ``modules`` (which override)."""
    found: dict[str, Mechanism] = {}
    if registry:
        try:
            reg = importlib.import_module("specpilot.mechanisms")
            for m in getattr(reg, "all_mechanisms", lambda: ())():
                found[m.id] = m
        except ImportError:
            pass
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"--mechanisms: cannot import module {name!r}: {e}") from None
        ms = getattr(mod, "MECHANISMS", None)
        if ms is None:
            raise ConfigError(f"--mechanisms: module {name!r} has no MECHANISMS sequence")
        for m in ms:
            found[m.id] = m
    for m in found.values():
        if m.factor not in FACTORS:
            raise ConfigError(f"mechanism {m.id}: factor {m.factor!r} is not one of {FACTORS}")
    return found


def check_params(mech: Mechanism, ctx: Context, plan: Plan, params: Mapping[str, Any]) -> dict:
    """``params`` validated against the mechanism's space (unknown or missing names fail)."""
    space: dict[str, Param] = {p.name: p for p in mech.space(ctx, plan)}
    extra = sorted(set(params) - set(space))
    if extra:
        raise ConfigError(f"mechanism {mech.id}: unknown parameter(s) {extra}")
    out = {}
    for name, p in space.items():
        out[name] = p.check(params[name]) if name in params else p.default
    return out


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


def _registered() -> set[str]:
    try:
        registry = importlib.import_module("specpilot.mechanisms")
        return {m.id for m in getattr(registry, "all_mechanisms", lambda: ())()}
    except ImportError:
        return set()


def registry_part(plan: Plan, extra: set[str]) -> Plan:
    """``plan`` without the provenance and options of mechanisms that only extra modules define
    (their effect is their ``wrap_decode`` hook, which the runtime does not know)."""
    if not extra:
        return plan
    return plan.replace(
        mechanisms=tuple(m for m in plan.mechanisms if m.id not in extra),
        options={k: v for k, v in plan.options.items() if k not in extra},
    )


def context_of(loaded: Any, plan: Plan, batch_size: int = 1) -> Context:
    """Where ``plan`` runs on ``loaded``: :func:`specpilot.runtime.context_of` when present."""
    try:
        runtime = importlib.import_module("specpilot.runtime")
        fn = getattr(runtime, "context_of", None)
    except ImportError:
        fn = None
    if fn is not None:
        return fn(loaded, plan, batch_size)
    import torch

    dev = plan.engine.device
    device = torch.cuda.get_device_name(0) if dev.startswith("cuda") else "cpu"
    return Context(
        arch=loaded.cfg.arch,
        params_m=round(loaded.cfg.n_params / 1e6, 1),
        drafter_kind=plan.drafter,
        device=device,
        dtype=plan.engine.dtype,
        batch_size=batch_size,
        threads=(plan.engine.threads or torch.get_num_threads()) if device == "cpu" else 0,
    )


def default_plan(loaded: Any = None) -> Plan:
    """The plan a run starts from: :func:`specpilot.runtime.default_plan` when present."""
    try:
        runtime = importlib.import_module("specpilot.runtime")
        fn = getattr(runtime, "default_plan", None)
    except ImportError:
        fn = None
    if fn is not None:
        try:
            return fn(loaded) if loaded is not None else fn()
        except TypeError:
            return fn()
    return Plan()


@dataclass
class Decoder:
    """A built plan in the trial subprocess: ``decode`` and what the cost model needs.

    One drafter serves consecutive requests (drafters that learn from earlier outputs, like
    suffix decoding, keep learning, as in ``bench`` rounds); :meth:`reset` starts a fresh one."""

    decode: Decode
    engine: Any
    make_drafter: Callable[[], Any]
    spec: Any
    holder: list[Any]

    def reset(self) -> None:
        self.holder[0] = self.make_drafter()


def build_decoder(
    plan: Plan, loaded: Any, mechanisms: Mapping[str, Mechanism], eos_ids: tuple[int, ...]
) -> Decoder:
    """Build ``plan`` and wrap ``decode`` with each applied mechanism's ``wrap_decode``."""
    try:
        runtime = importlib.import_module("specpilot.runtime")
        build = getattr(runtime, "build", None)
    except ImportError:
        build = None
    if build is not None:
        extra = {m.id for m in plan.mechanisms} - _registered()
        built = build(registry_part(plan, extra), loaded)
        engine, make, spec = built.engine, built.make_drafter, built.spec
    else:
        from specpilot.drafters import make_drafter
        from specpilot.engine import Engine

        engine = Engine(loaded.model, plan.engine)
        opts = dict(plan.drafter_options)

        def make() -> Any:
            return make_drafter(plan.drafter, target=loaded, tokenizer=loaded.tokenizer, **opts)

        spec = plan.tree
    holder = [make()]

    def decode(ids: list[int], gen: Any) -> Any:
        return engine.generate(ids, gen, drafter=holder[0], spec=spec, eos_ids=eos_ids)

    for applied in plan.mechanisms:
        mech = mechanisms.get(applied.id)
        wrap = getattr(mech, "wrap_decode", None)
        if wrap is not None:
            decode = wrap(decode, dict(applied.params))
    return Decoder(decode, engine, make, spec, holder)
