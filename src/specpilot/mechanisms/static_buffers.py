"""Mechanism ``static_buffers`` (overhead): verify-step buffers allocated once and reused.

The default step allocates and fills a fresh (rows x keys) mask and concatenates token and
position tensors every step; with this switch they live in buffers sized once per cache (SGLang
passes preallocated mask/position buffers to its verify step). Numerics are unchanged (same
values, same kernels). Runtime: ``EngineConfig.static_buffers`` (:mod:`specpilot.fastverify`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan


class StaticBuffers:
    id = "static_buffers"
    factor = "overhead"
    description = "preallocated token/position/mask buffers reused across verify steps"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return (Param("on", "bool", True),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return None

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return plan.replace(engine=replace(plan.engine, static_buffers=bool(params["on"])))
