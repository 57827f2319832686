"""Mechanism ``device_accept`` (overhead): greedy acceptance without host round trips.

The default step reads every row's argmax to the host, walks the tree in Python, then sends the
compaction indices back. With this switch acceptance is a few tensor ops on the device (a node
is accepted when it and all its ancestors match the target's choice; the deepest such node ends
the path) followed by ONE small device-to-host read; compaction and hidden-state rows use device
indices. Worth most on GPUs, where each sync stalls the launch queue. Runtime:
``EngineConfig.device_accept`` (:func:`specpilot.fastverify.accept_on_device`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan


class DeviceAccept:
    id = "device_accept"
    factor = "overhead"
    description = "greedy acceptance as device tensor ops, one host read per step"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return (Param("on", "bool", True),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return None

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return plan.replace(engine=replace(plan.engine, device_accept=bool(params["on"])))
