"""A planted order-breaking kernel variant for the kernel-mechanism tests.

``kernel_lanes4`` runs every native GGUF linear through the reference kernel with 4 accumulator
lanes instead of the numerics contract's 8: the same values within fp32 tolerance, other bits.
It is what a kernel "optimization" that reorders the reduction looks like, and token forcing must
reject it. :func:`four_lanes` applies it to a model in this process (no registration);
:mod:`tests.kernel_planted_child` registers the mechanism so a trial child builds it through
:func:`specpilot.runtime.build` and its ``configure`` hook.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from specpilot.errors import ConfigError
from specpilot.kernels import GGUFLinear, gguf_matmul_reference
from specpilot.mechanisms.base import Context, Param, RuntimeSetup, with_option
from specpilot.mechanisms.kernel_tiling import not_native
from specpilot.plan import Plan

LANES = 4


class FourLaneLinear(nn.Module):
    """A GGUFLinear computed in the reference order with :data:`LANES` lanes."""

    def __init__(self, inner: GGUFLinear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        m = self.inner
        y = gguf_matmul_reference(
            x.reshape(-1, m.in_features), m.blocks, m.qtype, m.out_features, m.in_features,
            m.bias, lanes=LANES,
        )  # fmt: skip
        return y.reshape(*x.shape[:-1], m.out_features)

    @property
    def weight(self) -> Tensor:
        return self.inner.weight


def four_lanes(model: nn.Module) -> int:
    """Swap every GGUFLinear of ``model`` for a :class:`FourLaneLinear`; how many were swapped."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, GGUFLinear)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, FourLaneLinear(child))
    return len(swaps)


class FourLanes:
    id = "kernel_lanes4"
    factor = "kernel"
    description = "planted: native linears with 4 accumulator lanes (breaks the contract's order)"

    @staticmethod
    def parse_options(raw: Any) -> dict[str, Any]:
        if raw != {}:
            raise ConfigError("plan options: kernel_lanes4 takes no options")
        return {}

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return ()

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return not_native(ctx)

    def configure(self, setup: RuntimeSetup, options: Mapping[str, Any]) -> None:
        if not four_lanes(setup.target):
            raise ConfigError("kernel_lanes4: the target has no native GGUF linears")

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return with_option(plan, self.id, {})


MECHANISMS = (FourLanes(),)
