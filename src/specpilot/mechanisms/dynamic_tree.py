"""Mechanism ``dynamic_tree`` (tau): best-first trees under a node budget.

EAGLE-2 (Li et al. 2024) and DDTree: candidates expanded ``topk`` per node up to ``depth``, the
best ``budget`` nodes by cumulative draft score verified. Acceptance rises with the budget and
speedup peaks at an intermediate one (the cost model's N*).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specpilot.mechanisms.base import Context, Param, no_drafter
from specpilot.plan import Plan
from specpilot.tree import TreeSpec


class DynamicTree:
    id = "dynamic_tree"
    factor = "tau"
    description = "draft tree = best-first under a node budget N (topk children, max depth)"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        t = plan.tree
        dyn = t.kind == "dynamic"
        return (
            Param("budget", "int", min(t.budget, 64) if dyn else 8, low=2, high=64, log=True),
            Param("topk", "int", min(t.topk, 8) if dyn else 2, low=1, high=8),
            Param("depth", "int", min(t.depth, 16) if dyn else 6, low=1, high=16),
        )

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return no_drafter(plan)

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        spec = TreeSpec(
            kind="dynamic",
            budget=int(params["budget"]),
            topk=int(params["topk"]),
            depth=int(params["depth"]),
        )
        return plan.replace(tree=spec)
