"""Mechanism ``kernel_tiling`` (kernel): the row and column tiles of the native GGUF GEMM.

Applies where the target runs its GGUF blocks through the native kernels (``--weights native``).
Calls of 5 rows or more (4 for the K-quants and dense types) decode each weight once into a
panel and run a micro-kernel of *row
tile* rows x *column tile* columns over it (at most 12 accumulators: it takes the largest row
group that fits, a remainder in groups of 3 and 2); fewer rows decode in registers for a group
of *row tile* rows and *column tile* columns (at most 8 accumulators, or 3 x 4; column tile 3
runs as 2; 3 rows share one decode).
Plain decoding calls it with one row and a verify step with 5-16, so the one-row column tile and
the multi-row row and column tiles are separate parameters (the op's defaults: 1 x 4 and 4 x 3;
with no tiles set, two and three rows run 2 x 4 and 3 x 4).
Tiles change the schedule only: each output element keeps the numerics contract's reduction
order (:mod:`specpilot.kernels`), so every choice gives the same bits (tests/test_kernels.py),
and token forcing checks it like any candidate. Thread count is the ``threads`` mechanism.
Runtime: :meth:`KernelTiling.configure`, options ``{"single": [1, ct], "multi": [rt, ct]}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specpilot.errors import ConfigError
from specpilot.kernels.linear import COL_TILES, ROW_TILES
from specpilot.mechanisms.base import (
    Context,
    Param,
    RuntimeSetup,
    parse_dataclass,
    require,
    with_option,
)
from specpilot.plan import Plan

DEFAULT_SINGLE = (1, 4)
DEFAULT_MULTI = (4, 3)
"""The op's own tiles for one row and for more (kernels/csrc/ops.cpp)."""
_WHERE = "plan options: kernel_tiling"


def _tiles(v: Any, what: str) -> tuple[int, int]:
    ok = isinstance(v, (list, tuple)) and len(v) == 2 and all(type(t) is int for t in v)
    require(ok, _WHERE, f"{what} must be [row tile, column tile], got {v!r}")
    require(v[0] in ROW_TILES, _WHERE, f"{what} row tile must be one of {list(ROW_TILES)}")
    require(v[1] in COL_TILES, _WHERE, f"{what} column tile must be one of {list(COL_TILES)}")
    return int(v[0]), int(v[1])


@dataclass(frozen=True)
class TilingOptions:
    single: tuple[int, int] = DEFAULT_SINGLE
    """(row tile, column tile) of one-row calls (plain decoding)."""
    multi: tuple[int, int] = DEFAULT_MULTI
    """(row tile, column tile) of multi-row calls (verify steps, prefill)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "single", _tiles(self.single, "single"))
        object.__setattr__(self, "multi", _tiles(self.multi, "multi"))


def not_native(ctx: Context) -> str | None:
    """Why the native GGUF kernels do not run the target here, or None when they do."""
    from specpilot import kernels

    if ctx.on_gpu:
        return "the native GGUF kernels run on CPU; this target runs on a GPU"
    if not ctx.native:
        return "the target runs dequantized fp32 weights (a .gguf with --weights native runs them)"
    return kernels.unavailable_reason()


class KernelTiling:
    id = "kernel_tiling"
    factor = "kernel"
    description = "native GGUF GEMM: row and column tiles of one-row (plain) and verify calls"

    @staticmethod
    def parse_options(raw: Any) -> TilingOptions:
        return parse_dataclass(TilingOptions, raw, _WHERE)

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        raw = plan.options.get(self.id)
        now = self.parse_options(raw) if raw is not None else TilingOptions()
        return (
            Param("single_col_tile", "categorical", now.single[1], choices=COL_TILES),
            Param("multi_row_tile", "categorical", now.multi[0], choices=ROW_TILES),
            Param("multi_col_tile", "categorical", now.multi[1], choices=COL_TILES),
        )

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return not_native(ctx)

    def configure(self, setup: RuntimeSetup, options: TilingOptions) -> None:
        from specpilot.kernels.linear import set_schedule

        if not set_schedule(setup.target, options.single, options.multi):
            raise ConfigError(
                "kernel_tiling: the target has no native GGUF linears (load a .gguf with "
                "--weights native, or drop kernel_tiling from the plan)"
            )
        if setup.draft is not None:  # a native draft model runs the same GEMM
            set_schedule(setup.draft, options.single, options.multi)

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        value = {
            "single": [1, int(params["single_col_tile"])],
            "multi": [int(params["multi_row_tile"]), int(params["multi_col_tile"])],
        }
        return with_option(plan, self.id, value)
