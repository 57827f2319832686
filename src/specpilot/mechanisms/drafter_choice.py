"""Mechanism ``drafter_choice`` (tau): which drafter proposes the trees.

Prompt lookup (n-gram copy, Saxena 2023), suffix trees over prompt and earlier outputs
(SuffixDecoding), a draft model, or a trained drafter directory, whichever the context offers.
Switching drafter drops the previous drafter's options; a hybrid fallback equal to the new
drafter, and a reduced draft vocabulary without a draft model, are dropped too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specpilot.mechanisms.base import Context, Param, no_drafter, with_option
from specpilot.plan import Plan


class DrafterChoice:
    id = "drafter_choice"
    factor = "tau"
    description = "drafter: prompt lookup, suffix tree, draft model or a trained drafter"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        choices = tuple(ctx.drafters)
        default = plan.drafter if plan.drafter in choices else choices[0]
        return (Param("drafter", "categorical", default, choices=choices),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        if len(ctx.drafters) < 2:
            return f"only one drafter can be built here ({', '.join(ctx.drafters)})"
        return no_drafter(plan)

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        name = str(params["drafter"])
        if name == plan.drafter:
            return plan
        out = plan.replace(drafter=name, drafter_options={})
        hybrid = out.options.get("hybrid_drafting")
        if isinstance(hybrid, Mapping) and hybrid.get("fallback") == name:
            out = with_option(out, "hybrid_drafting", None)
        if name != "model" and "draft_vocab" in out.options:
            hybrid = out.options.get("hybrid_drafting")
            if not (isinstance(hybrid, Mapping) and hybrid.get("fallback") == "model"):
                out = with_option(out, "draft_vocab", None)
        return out
