"""Mechanism ``goodput_budget`` (tau): the verify budget chosen per step by expected tokens per
second (:mod:`specpilot.goodput`) instead of a fixed tree size.

Each step keeps the draft nodes whose calibrated acceptance pays for their measured verify cost,
across the whole batch, down to zero nodes and no drafting (plain decoding) where the drafter
does not pay: a fixed draft length wins at low load and loses at high load, this one follows
the load. Tunable: the hysteresis that keeps it from flapping, how often it probes the
drafter while plain decoding wins, and the cost curve's calibration: how many verify rows it is
measured at (``curve_rows``: 1, 2, 4, .. up to it; a new row set is a new cached curve) and how
much one observed step moves it (``smoothing``). Numerics are unchanged (it only drops draft
nodes). Runtime: ``EngineConfig.goodput`` and its ``goodput_*`` settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from specpilot.mechanisms.base import Context, Param, no_drafter
from specpilot.plan import Plan


class GoodputBudget:
    id = "goodput_budget"
    factor = "tau"
    description = "per-step verify budget by expected tokens per second (down to plain decoding)"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return (
            Param("on", "bool", True),
            Param("hysteresis", "float", 0.05, low=0.0, high=0.3),
            Param("probe_every", "int", 8, low=2, high=32, log=True),
            Param("curve_rows", "categorical", 64, choices=(16, 32, 64)),
            Param("smoothing", "float", 0.2, low=0.0, high=0.5),
        )

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return no_drafter(plan)

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        engine = replace(
            plan.engine,
            goodput=bool(params["on"]),
            goodput_hysteresis=float(params["hysteresis"]),
            goodput_probe=int(params["probe_every"]),
            goodput_rows=int(params["curve_rows"]),
            goodput_smoothing=float(params["smoothing"]),
        )
        return plan.replace(engine=engine)
