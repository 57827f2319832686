"""Mechanism ``attention_impl`` (kernel): which attention kernel verifies the tree.

``exact`` keeps the KV cache in fp64 and runs attention in fp64 (batch-invariant: a verified row
gives the bits plain decoding gives; see :mod:`specpilot.model`), ``sdpa`` runs torch's native
scaled-dot-product attention in the model dtype (faster, half the cache memory, but its result
may depend on the number of rows verified). This mechanism does not claim sdpa is lossless:
token forcing on held-back prompts decides whether a plan with it keeps the reference output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan


class AttentionImpl:
    id = "attention_impl"
    factor = "kernel"
    description = "attention: exact (fp64, batch-invariant) or sdpa (native; forcing decides)"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        now = plan.engine.resolved_attention
        return (Param("attention", "categorical", now, choices=("exact", "sdpa")),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return None

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return plan.replace(engine=replace(plan.engine, attention=str(params["attention"])))
