"""Mechanism ``union_gate`` (tau): when a trained drafter runs beside the suffix drafter.

The head+suffix union (:mod:`specpilot.drafters.union`) asks both drafters every step; each
depth of the trained head costs a forward of its own, about as much as a few verify rows on a
CPU. Three knobs trade acceptance for drafting cost:

* ``trust``: a suffix match of at least this many tokens drafts alone (the head does not run;
  its target states are fed in one batch the next time it is asked); 0 = always merge;
* ``trained_depth``: the head's trees are cut to this depth (its acceptance falls fast with
  depth); 0 = the tree spec's depth;
* ``min_prob``: head nodes whose path probability under the head is below this are not
  expanded (EAGLE-2's confidence, used to stop early rather than to rank).

Unset options run at :data:`specpilot.defaults.UNION_DEFAULTS`; the search starts there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specpilot.defaults import UNION_DEFAULTS
from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan


class UnionGate:
    id = "union_gate"
    factor = "tau"
    description = "head+suffix: suffix alone on long matches, head depth, head confidence stop"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        o = {**UNION_DEFAULTS, **plan.drafter_options}  # what the plan runs now
        return (
            Param("trust", "int", min(int(o["trust"]), 8), low=0, high=8),
            Param("trained_depth", "int", min(int(o["trained_depth"]), 8), low=0, high=8),
            Param("min_prob", "float", min(float(o["min_prob"]), 0.6), low=0.0, high=0.6),
        )

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        if not plan.drafter.endswith("+suffix"):
            return f"the drafter is {plan.drafter}, not a trained drafter + suffix"
        return None

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        opts = {
            "trust": int(params["trust"]),
            "trained_depth": int(params["trained_depth"]),
            "min_prob": float(params["min_prob"]),
        }
        return plan.replace(drafter_options=opts)
