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
        """Thread counts 1..all; a plan that leaves threads unset already runs on all of them,
        so "all" is left out then: as a candidate it would time the start plan against itself."""
        most = max(ctx.threads, 1)
        now = plan.engine.threads or most
        high = most - 1 if plan.engine.threads is None and most > 1 else most
        return (Param("threads", "int", min(now, high), low=1, high=high),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        if ctx.on_gpu:
            return "the model runs on a GPU; host threads do not run its kernels"
        if ctx.threads < 2:
            return "one CPU thread available"
        return None

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return plan.replace(engine=replace(plan.engine, threads=int(params["threads"])))
