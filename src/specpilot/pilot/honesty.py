"""The loop's honesty check: a measured speedup above what the cost model says is possible.

The ceiling of a plan is its tokens per step over the floor of a step: no step commits more than
the tree's longest path plus one token (:func:`max_tokens_per_step`), and no step takes less than
the sum of the roofline floors of its kernel classes (the round's cost-model profile,
:func:`step_floor_ms`). Against a baseline measured at ``base_tok_s`` tokens/s, a candidate can
then be at most ``ceiling_tok_s / base_tok_s`` times faster (:func:`ceiling`). A trial reporting
more is flagged in the round log and re-measured before it can be kept (the coordinator's
integration); a re-measurement still above the ceiling is not kept (outputs answered from a
cache, a clock that is not the parent's, or floors that are wrong - either way not a speedup to
build on).

No ceiling is claimed (None) without a profile with floors, without a measured baseline, or when
the candidate runs on another device or dtype than the profiled plan (the floors would differ).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specpilot.plan import Plan


def max_tokens_per_step(plan: Plan) -> int:
    """Tokens one step of ``plan`` can commit at most: accepted drafts plus the bonus token."""
    if plan.drafter == "none":
        return 1
    spec = plan.tree
    return min(spec.max_depth, spec.max_nodes) + 1


def step_floor_ms(report: Mapping[str, Any] | None) -> float | None:
    """The floor of one decode step (ms): the sum of the kernel classes' roofline floors."""
    kernels = (report or {}).get("kernels") or []
    try:
        floor = sum(float(k["floor_ms"]) for k in kernels)
    except (KeyError, TypeError, ValueError):
        return None
    return floor if floor > 0 else None


def ceiling(report: Mapping[str, Any] | None, profiled: Plan, candidate: Plan,
            base_tok_s: float | None) -> float | None:  # fmt: skip
    """The largest speedup over a baseline at ``base_tok_s`` that ``candidate`` can reach, by the
    cost model of the ``profiled`` plan; None when it cannot be said (see the module)."""
    floor = step_floor_ms(report)
    if floor is None or not base_tok_s or base_tok_s <= 0:
        return None
    same = (profiled.engine.device, profiled.engine.dtype)
    if (candidate.engine.device, candidate.engine.dtype) != same:
        return None
    return max_tokens_per_step(candidate) / (floor / 1e3) / base_tok_s


def above(speedup: float | None, limit: float | None) -> bool:
    """A reported speedup above the ceiling."""
    return speedup is not None and limit is not None and speedup > limit
