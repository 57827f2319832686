"""Mechanism ``attention_impl`` (kernel): which attention kernel verifies the tree.

``fixed`` runs the batch-invariant fp32 kernel (:func:`specpilot.kernels.fixed_attention`,
fixed order by contract; the CPU default when the kernels build), ``exact`` keeps the KV cache in
fp64 and runs attention in fp64 (batch-invariant: a verified row gives the bits plain decoding
gives; see :mod:`specpilot.model`), ``sdpa`` runs torch's native scaled-dot-product attention in
the model dtype (faster, half the cache memory, but its result may depend on the number of rows
verified). On CPU sdpa is no candidate: it changes the target's numerics outside the contract,
and passing forcing on a finite pool would not make it lossless on the next prompt (its one-line
reason says so where nothing else is left to choose). On GPU it stays a choice and token forcing
decides, as for every candidate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from specpilot import kernels
from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan

CPU_OUTSIDE_CONTRACT = "sdpa"
"""The attention kind that is no candidate on CPU (see the module docstring)."""


class AttentionImpl:
    id = "attention_impl"
    factor = "kernel"
    description = (
        "attention: fixed (fp32 kernel, batch-invariant), exact (fp64, batch-invariant) or sdpa "
        "(native, GPU only; forcing decides)"
    )

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        e = plan.engine
        now = e.resolved_attention
        cpu32 = e.device == "cpu" and e.dtype == "float32"
        choices = ("fixed", "exact", "sdpa") if cpu32 and kernels.available() else ("exact", "sdpa")
        if not ctx.on_gpu:
            choices = tuple(c for c in choices if c != CPU_OUTSIDE_CONTRACT)
            now = now if now in choices else choices[0]
        return (Param("attention", "categorical", now, choices=choices),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        (p,) = self.space(ctx, plan)
        if not ctx.on_gpu and p.choices == (plan.engine.resolved_attention,):
            return (
                f"on CPU sdpa changes the target's numerics outside the contract (no candidate) "
                f"and the plan already runs {p.choices[0]}, the only kind left here"
            )
        return None

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return plan.replace(engine=replace(plan.engine, attention=str(params["attention"])))
