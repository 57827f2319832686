"""Mechanism ``gpu_dtype`` (kernel): the target's dtype on a GPU.

bf16/fp16 halve the bytes every decode step reads (decode is bandwidth-bound) and use tensor
cores. The reference is the plan's own dtype only if forcing runs against a reference in the same
dtype; against an fp32 reference, near-ties may flip and forcing decides.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan

GPU_DTYPES = ("bfloat16", "float16", "float32")


class GpuDtype:
    id = "gpu_dtype"
    factor = "kernel"
    description = "target dtype on GPU: bfloat16, float16 or float32"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return (Param("dtype", "categorical", plan.engine.dtype, choices=GPU_DTYPES),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return None if ctx.on_gpu else "bf16/fp16 have no native matmuls on this CPU (GPU only)"

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return plan.replace(engine=replace(plan.engine, dtype=str(params["dtype"])))
