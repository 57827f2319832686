"""Mechanism ``lookup_ngram`` (tau): the n-gram sizes and tree merging of prompt lookup.

vLLM ``prompt_lookup_min`` / ``prompt_lookup_max``; HF ``prompt_lookup_num_tokens``. Longer
n-grams match less often but more reliably; ``max_matches`` earlier occurrences merge into a
tree whose node scores decay by ``discount`` per depth (see
:mod:`specpilot.drafters.prompt_lookup`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan


class LookupNgram:
    id = "lookup_ngram"
    factor = "tau"
    description = "prompt lookup: n-gram sizes (min_n..max_n), matches merged, depth discount"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        o = plan.drafter_options
        min_n = int(o.get("min_n", 1))
        return (
            Param("min_n", "int", min(max(min_n, 1), 4), low=1, high=4),
            Param("span", "int", min(max(int(o.get("max_n", 4)) - min_n, 0), 6), low=0, high=6),
            Param("max_matches", "int", min(int(o.get("max_matches", 8)), 16), low=1, high=16),
            Param("discount", "float", float(o.get("discount", 0.9)), low=0.5, high=1.0),
        )

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return None if plan.drafter == "lookup" else f"the drafter is {plan.drafter}, not lookup"

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        min_n = int(params["min_n"])
        opts = {
            "min_n": min_n,
            "max_n": min_n + int(params["span"]),
            "max_matches": int(params["max_matches"]),
            "discount": float(params["discount"]),
        }
        return plan.replace(drafter_options=opts)
