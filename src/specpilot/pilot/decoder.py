"""A plan built in the trial subprocess: one ``decode`` function and what the cost model needs.

:func:`build_decoder` builds the registry part of a plan with :func:`specpilot.runtime.build`
and wraps ``decode(prompt_ids, GenerationConfig) -> GenerationResult`` with each applied
mechanism's optional ``wrap_decode(decode, params)`` hook. That hook is called only here,
inside the untrusted trial subprocess, never in the trusted parent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from specpilot import runtime
from specpilot.mechanisms.base import Mechanism
from specpilot.pilot.steps import registered_ids, registry_part
from specpilot.plan import Plan

Decode = Callable[[list[int], Any], Any]
"""``decode(prompt_ids, GenerationConfig) -> GenerationResult``."""


@dataclass
class Decoder:
    """A built plan: ``decode`` and what the cost model needs.

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
    extra = {m.id for m in plan.mechanisms} - registered_ids()
    built = runtime.build(registry_part(plan, extra), loaded)
    engine, spec = built.engine, built.spec
    holder = [built.make_drafter()]

    def decode(ids: list[int], gen: Any) -> Any:
        return engine.generate(ids, gen, drafter=holder[0], spec=spec, eos_ids=eos_ids)

    for applied in plan.mechanisms:
        wrap = getattr(mechanisms.get(applied.id), "wrap_decode", None)
        if wrap is not None:
            decode = wrap(decode, dict(applied.params))
    return Decoder(decode, engine, built.make_drafter, spec, holder)
