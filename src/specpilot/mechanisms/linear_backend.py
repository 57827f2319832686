"""Mechanism ``linear_backend`` (kernel): prepacked oneDNN GEMMs or torch's stock linear.

On this CPU the stock path repacks weights on every GEMV -> GEMM switch (the LM head: 7.8 ms for
1 row, 18 ms for 2; prepacked 5.8 ms, REFERENCES.md); oneDNN-prepacked fused q/k/v and gate/up
weights avoid it and are batch-invariant. ``torch`` is kept as a choice: it is what
``compile_forward`` can fuse through, and other CPUs may differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan

_NO_LINEARS = ("lookup", "suffix")
"""Drafters that run no linear layer (the training-free ones)."""


class LinearBackend:
    id = "linear_backend"
    factor = "kernel"
    description = "CPU fp32 linears: oneDNN prepacked + fused projections, or stock torch"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return (Param("linear", "categorical", plan.engine.linear, choices=("onednn", "torch")),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        from specpilot.kernels.onednn import onednn_available

        if ctx.on_gpu or ctx.dtype != "float32":
            return "prepacked oneDNN linears are for CPU fp32"
        if not onednn_available():
            return "this torch build has no oneDNN (mkldnn) linear"
        if ctx.native and plan.drafter in _NO_LINEARS:
            return (
                "the target runs its GGUF blocks through the native kernels and the "
                f"{plan.drafter} drafter has no linears: no fp32 GEMM runs"
            )
        return None

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return plan.replace(engine=replace(plan.engine, linear=str(params["linear"])))
