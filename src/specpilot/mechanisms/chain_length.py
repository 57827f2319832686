"""Mechanism ``chain_length`` (tau): draft a chain of k tokens per step.

The speculation length of Leviathan et al. (2023), gpt-fast ``--speculate_k``, vLLM
``num_speculative_tokens``. Longer chains raise tau while the drafter stays right and cost a
wider verify; on this CPU verifying up to ~8 rows costs about one plain step (BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specpilot.mechanisms.base import Context, Param, no_drafter
from specpilot.plan import Plan
from specpilot.tree import TreeSpec

MAX_K = 16


class ChainLength:
    id = "chain_length"
    factor = "tau"
    description = "draft tree = a chain of k tokens (speculation length k)"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        k = plan.tree.k if plan.tree.kind == "chain" else 5
        return (Param("k", "int", min(max(k, 1), MAX_K), low=1, high=MAX_K),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return no_drafter(plan)

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return plan.replace(tree=TreeSpec(kind="chain", k=int(params["k"])))
