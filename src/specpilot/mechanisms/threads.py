"""Mechanism ``threads`` (kernel): CPU threads torch runs the model with.

On a small CPU, GEMV bandwidth saturates before all cores are busy and extra threads add
synchronization; the best count is measured, not assumed (``torch.set_num_threads``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan


class Threads:
    id = "threads"
    factor = "kernel"
    description = "CPU threads for torch's kernels"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        most = max(ctx.threads, 1)
        now = plan.engine.threads or most
        return (Param("threads", "int", min(now, most), low=1, high=most),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        if ctx.on_gpu:
            return "the model runs on a GPU; host threads do not run its kernels"
        if ctx.threads < 2:
            return "one CPU thread available"
        return None

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return plan.replace(engine=replace(plan.engine, threads=int(params["threads"])))
