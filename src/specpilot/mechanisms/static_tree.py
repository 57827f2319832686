"""Mechanism ``static_tree`` (tau): a fixed tree shape from a family parameterized by size.

Static trees verify several candidates per depth (Medusa / EAGLE-1 trees, vLLM
``speculative_token_tree``, SGLang's top-k trees). The family here: a main chain of ``depth``
best-ranked nodes; at each of its first ``branch_depth`` levels, ``width - 1`` lower-ranked
siblings, each continued by up to ``tail`` best-ranked nodes (never deeper than ``depth``).

    >>> static_paths(width=2, depth=3, branch_depth=1, tail=1)
    ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specpilot.mechanisms.base import Context, Param, no_drafter
from specpilot.plan import Plan
from specpilot.tree import TreeSpec


def static_paths(
    width: int, depth: int, branch_depth: int, tail: int
) -> tuple[tuple[int, ...], ...]:
    """Rank paths of the family member (shortest first, then lexicographic)."""
    paths = {(0,) * d for d in range(1, depth + 1)}
    for level in range(1, min(branch_depth, depth) + 1):
        stem = (0,) * (level - 1)
        for r in range(1, width):
            for t in range(0, tail + 1):
                if level + t <= depth:
                    paths.add((*stem, r, *(0,) * t))
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


class StaticTree:
    id = "static_tree"
    factor = "tau"
    description = "draft tree = a fixed shape: main chain + lower-ranked siblings near the root"

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return (
            Param("width", "int", 2, low=1, high=4),
            Param("depth", "int", 4, low=1, high=10),
            Param("branch_depth", "int", 1, low=1, high=4),
            Param("tail", "int", 0, low=0, high=3),
        )

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return no_drafter(plan)

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        paths = static_paths(
            int(params["width"]),
            int(params["depth"]),
            int(params["branch_depth"]),
            int(params["tail"]),
        )
        return plan.replace(tree=TreeSpec(kind="static", paths=paths))
