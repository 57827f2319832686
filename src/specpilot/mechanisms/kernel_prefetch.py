"""Mechanism ``kernel_prefetch`` (kernel): how far ahead the int8 GEMMs stream their weights.

Applies where the target runs its GGUF blocks through the native kernels in the int8-activation
numerics profile (``--numerics int8``). A decode step streams every weight from memory once, and
on some CPUs the hardware prefetchers barely help: on a 2-core EPYC Zen 4 a distance of 8 columns
instead of 16 cost 13% a forward, 4 columns ~40% (BENCHMARKS.md, fifth session of 2026-12-07).
The best distance depends on the memory latency, the core's miss buffers and the weight type's
bytes per column, so it is measured per machine: the GEMMs prefetch the weights ``columns``
output columns ahead of the one they compute (0: each schedule's own, 8 columns in GGUF order,
16 in the packed layout; :data:`specpilot.kernels.int8.PREFETCH_COLUMNS` are tried).

A schedule choice only: each output element keeps the numerics contract's reduction order
(:mod:`specpilot.kernels`), so every distance gives the same bits (tests/test_kernels_packed.py),
and token forcing checks it like any candidate. The setting holds for every int8 GEMM of the
process, as the ``threads`` mechanism's thread count does.
Runtime: :meth:`KernelPrefetch.configure`, options ``{"columns": N}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specpilot.errors import ConfigError
from specpilot.kernels.int8 import PREFETCH_COLUMNS
from specpilot.mechanisms.base import (
    Context,
    Param,
    RuntimeSetup,
    parse_dataclass,
    require,
    with_option,
)
from specpilot.mechanisms.kernel_tiling import not_native
from specpilot.plan import Plan

_WHERE = "plan options: kernel_prefetch"


@dataclass(frozen=True)
class PrefetchOptions:
    columns: int = 0
    """Output columns ahead that the weight stream is prefetched (0: the schedules' own)."""

    def __post_init__(self) -> None:
        ok = type(self.columns) is int and self.columns in PREFETCH_COLUMNS
        require(ok, _WHERE, f"columns must be one of {list(PREFETCH_COLUMNS)}, got "
                            f"{self.columns!r}")  # fmt: skip


class KernelPrefetch:
    id = "kernel_prefetch"
    factor = "kernel"
    description = "native int8 GEMM: software prefetch distance of the weight stream"

    @staticmethod
    def parse_options(raw: Any) -> PrefetchOptions:
        return parse_dataclass(PrefetchOptions, raw, _WHERE)

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        raw = plan.options.get(self.id)
        now = self.parse_options(raw) if raw is not None else PrefetchOptions()
        return (Param("columns", "categorical", now.columns, choices=PREFETCH_COLUMNS),)

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        why = not_native(ctx)
        if why is None and plan.engine.numerics != "int8":
            why = "the prefetch distance is the int8 GEMMs' (--numerics int8); this plan runs fp32"
        return why

    def configure(self, setup: RuntimeSetup, options: PrefetchOptions) -> None:
        from specpilot.kernels import int8, unavailable_reason

        why = unavailable_reason()
        if why is not None:
            raise ConfigError(f"kernel_prefetch: the native kernels are not available ({why})")
        int8.set_prefetch(options.columns)

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return with_option(plan, self.id, {"columns": int(params["columns"])})
