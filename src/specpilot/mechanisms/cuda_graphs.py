"""Mechanism ``cuda_graphs`` (overhead): replay the verify forward from captured CUDA graphs.

A decode step of a small model launches hundreds of kernels; on a GPU their launch cost, not the
math, sets the step time. vLLM and SGLang capture decode into CUDA graphs at fixed batch sizes;
here the verify forward is captured per (padded tree width, padded key length) bucket and
replayed (dummy rows see only the root; padded keys are masked out). Implies ``static_buffers``
and ``device_accept``. Runtime: ``EngineConfig.cuda_graphs`` (:mod:`specpilot.fastverify`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan


class CudaGraphs:
    id = "cuda_graphs"
    factor = "overhead"
    description = "verify forward replayed from CUDA graphs captured at padded static shapes"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return (Param("on", "bool", True),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        if not ctx.on_gpu or not plan.engine.device.startswith("cuda"):
            return "CUDA graphs need a CUDA device (this context is CPU)"
        return None

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return plan.replace(engine=replace(plan.engine, cuda_graphs=bool(params["on"])))
