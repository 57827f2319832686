"""Mechanism ``hybrid_drafting`` (tau): a second drafter for the steps the first one misses.

Lookup / suffix drafting is nearly free but proposes nothing when the text does not repeat;
asking a second drafter on those steps (a draft model, or the other training-free drafter)
turns them into speculative steps too (the "lookup first, model fallback" of vLLM/SGLang n-gram
+ EAGLE setups). Runtime: :class:`specpilot.drafters.hybrid.HybridDrafter`, options
``{"fallback": name, "min_nodes": m, "fallback_options": {...}}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specpilot.drafters.base import Drafter
from specpilot.errors import ConfigError
from specpilot.mechanisms.base import (
    Context,
    Param,
    RuntimeSetup,
    no_drafter,
    parse_dataclass,
    require,
    with_option,
)
from specpilot.plan import Plan

FALLBACKS = ("lookup", "suffix", "model")


@dataclass(frozen=True)
class HybridOptions:
    fallback: str
    """Drafter asked when the plan's drafter proposes fewer than ``min_nodes`` nodes."""
    min_nodes: int = 1
    fallback_options: Mapping[str, Any] = field(default_factory=dict)
    """Constructor options of the fallback drafter."""

    def __post_init__(self) -> None:
        w = "plan options: hybrid_drafting"
        require(self.fallback in FALLBACKS, w, f"fallback must be one of {FALLBACKS}")
        require(
            isinstance(self.min_nodes, int) and 1 <= self.min_nodes <= 16,
            w,
            "min_nodes must be an integer in 1..16",
        )
        require(isinstance(self.fallback_options, Mapping), w, "fallback_options: an object")


class HybridDrafting:
    id = "hybrid_drafting"
    factor = "tau"
    description = "hybrid drafting: a fallback drafter when the drafter proposes (almost) nothing"

    @staticmethod
    def parse_options(raw: Any) -> HybridOptions:
        return parse_dataclass(HybridOptions, raw, "plan options: hybrid_drafting")

    def _fallbacks(self, ctx: Context, plan: Plan) -> tuple[str, ...]:
        return tuple(d for d in FALLBACKS if d in ctx.drafters and d != plan.drafter)

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        choices = self._fallbacks(ctx, plan) or FALLBACKS
        default = "model" if "model" in choices else choices[0]
        return (
            Param("fallback", "categorical", default, choices=choices),
            Param("min_nodes", "int", 1, low=1, high=4),
        )

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        if no_drafter(plan):
            return no_drafter(plan)
        if plan.drafter not in FALLBACKS:
            return "the drafter reads target hidden states; a fallback would miss some of them"
        if not self._fallbacks(ctx, plan):
            return "no second drafter can be built here"
        return None

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        value = {"fallback": str(params["fallback"]), "min_nodes": int(params["min_nodes"])}
        return with_option(plan, self.id, value)

    def configure(self, setup: RuntimeSetup, options: HybridOptions) -> None:
        from specpilot.drafters.hybrid import HybridDrafter

        if options.fallback == "model" and setup.draft is None:
            raise ConfigError("the plan drafts with a draft model: give one (--draft-model PATH)")

        def wrap(d: Drafter) -> Drafter:
            fb = setup.base_drafter(options.fallback, options.fallback_options)
            assert fb is not None
            return HybridDrafter(d, fb, options.min_nodes)

        setup.wrappers.append(wrap)
