"""Mechanism ``adaptive_draft`` (tau): draft length adapted to draft confidence.

Trees are cut where the cumulative draft score falls below ``log(threshold)`` (keeping at least
``min_nodes`` best nodes), so unsure steps verify fewer rows (DSpark's confidence head, EAGLE-2's
dynamic depth). Runtime: :class:`specpilot.drafters.adaptive.ConfidenceDrafter`, options
``{"threshold": t, "min_nodes": m}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class AdaptiveOptions:
    threshold: float
    """Keep nodes whose path probability (exp of the cumulative score) is at least this."""
    min_nodes: int = 1

    def __post_init__(self) -> None:
        w = "plan options: adaptive_draft"
        require(
            isinstance(self.threshold, (int, float)) and 0.0 < self.threshold <= 1.0,
            w,
            "threshold must be a number in (0, 1]",
        )
        require(
            isinstance(self.min_nodes, int) and 0 <= self.min_nodes <= 64,
            w,
            "min_nodes must be an integer in 0..64",
        )


class AdaptiveDraft:
    id = "adaptive_draft"
    factor = "tau"
    description = "adaptive draft length: cut the tree where the path's draft confidence drops"

    @staticmethod
    def parse_options(raw: Any) -> AdaptiveOptions:
        return parse_dataclass(AdaptiveOptions, raw, "plan options: adaptive_draft")

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return (
            Param("threshold", "float", 0.1, low=0.005, high=0.9, log=True),
            Param("min_nodes", "int", 1, low=0, high=4),
        )

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return no_drafter(plan)

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        value = {"threshold": float(params["threshold"]), "min_nodes": int(params["min_nodes"])}
        return with_option(plan, self.id, value)

    def configure(self, setup: RuntimeSetup, options: AdaptiveOptions) -> None:
        from specpilot.drafters.adaptive import ConfidenceDrafter

        setup.wrappers.append(
            lambda d: ConfidenceDrafter(d, options.threshold, options.min_nodes)
        )
