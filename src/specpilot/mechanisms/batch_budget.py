"""Mechanism ``batch_budget`` (tau): a node budget per batch size.

Verification work grows with the batch, so speculation must shrink as concurrency rises (vLLM's
dynamic K per batch size; REFERENCES: k=2 beat 4 at 8-way concurrency). The plan keeps a plain
mapping batch size -> node budget in ``options["batch_budget"]`` (JSON keys are strings); a run
at batch size b verifies at most the budget of the largest entry <= b
(:func:`budget_for`), applied by :meth:`BatchBudgetTable.configure` and the batched
engine. Each application sets the entry of the context's batch size and keeps the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specpilot.errors import ConfigError
from specpilot.mechanisms.base import Context, Param, RuntimeSetup, no_drafter, with_option
from specpilot.plan import Plan
from specpilot.tree import TreeSpec


@dataclass(frozen=True)
class BatchBudget:
    table: Mapping[int, int]
    """Batch size -> most draft nodes verified per sequence per step."""


def parse_table(raw: Any) -> BatchBudget:
    """``{"1": 16, "4": 8}`` -> BatchBudget({1: 16, 4: 8}); ConfigError on anything else."""
    where = "plan options: batch_budget"
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(f"{where}: expected a non-empty object batch size -> node budget")
    table: dict[int, int] = {}
    for k, v in raw.items():
        try:
            b = int(k)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: batch size {k!r} is not an integer") from None
        if b < 1 or isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{where}: entry {k!r}: {v!r}; need batch size >= 1, budget >= 1")
        table[b] = v
    return BatchBudget(table)


def budget_for(table: Mapping[int, int], batch_size: int) -> int | None:
    """The node budget for ``batch_size``: the entry of the largest batch size <= it (None when
    the table has none). Read by the batched engine as well.

    >>> budget_for({1: 16, 4: 8, 16: 2}, 6)
    8
    """
    keys = [b for b in table if b <= batch_size]
    return table[max(keys)] if keys else None


def cap_spec(spec: TreeSpec, budget: int) -> TreeSpec:
    """``spec`` verifying at most ``budget`` draft nodes (static paths: shortest first, closed).

    >>> cap_spec(TreeSpec(kind="static", paths=((0,), (1,), (0, 0), (0, 0, 0))), 3).paths
    ((0,), (1,), (0, 0))
    """
    if budget >= spec.max_nodes:
        return spec
    if spec.kind == "chain":
        return TreeSpec(kind="chain", k=budget)
    if spec.kind == "dynamic":
        return TreeSpec(kind="dynamic", budget=budget, topk=spec.topk, depth=spec.depth)
    kept: list[tuple[int, ...]] = []
    for p in sorted(spec.paths, key=len):
        if len(kept) < budget and (len(p) == 1 or p[:-1] in kept):
            kept.append(p)
    return TreeSpec(kind="static", paths=tuple(kept))


class BatchBudgetTable:
    id = "batch_budget"
    factor = "tau"
    description = "node budget per batch size (fewer draft nodes as concurrency rises)"

    @staticmethod
    def parse_options(raw: Any) -> BatchBudget:
        return parse_table(raw)

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        most = max(plan.tree.max_nodes, 1)
        return (
            Param("batch_size", "categorical", ctx.batch_size, choices=(ctx.batch_size,)),
            Param("budget", "int", most, low=1, high=most),
        )

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return no_drafter(plan)

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        raw = plan.options.get(self.id)
        table = dict(parse_table(raw).table) if raw else {}
        table[int(params["batch_size"])] = int(params["budget"])
        return with_option(plan, self.id, {str(b): table[b] for b in sorted(table)})

    def configure(self, setup: RuntimeSetup, options: BatchBudget) -> None:
        cap = budget_for(options.table, setup.batch_size)
        if cap is not None:
            setup.spec = cap_spec(setup.spec, cap)
