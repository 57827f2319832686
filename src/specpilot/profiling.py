"""Named profiler ranges around the kernel classes of a forward (read by the cost model).

With :func:`set_kernel_ranges` on, each kernel class of :data:`KERNEL_CLASSES` runs in a
``torch.profiler.record_function`` range of its name (:mod:`specpilot.costmodel.measure` sums
them); off (the default) the ranges are one shared no-op context and nothing else changes.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch.profiler import record_function

KERNEL_CLASSES = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head")
"""Named profiler ranges of one forward (the cost model's kernel classes). ``qkv`` holds the input
RMSNorm, the q/k/v projection, q/k norms and RoPE; ``attention`` the cache write and SDPA;
``gate_up`` the post-attention RMSNorm, the gate/up projection and SiLU x up; ``lm_head`` the
final RMSNorm and the LM head. Residual adds and the embedding gather stay outside (glue), except
that with the row ops on (:mod:`specpilot.kernels.rowops`) the post-attention residual add is one
op with the norm in ``gate_up``."""

_ranges_on = False
_NO_RANGE = contextlib.nullcontext()


def set_kernel_ranges(on: bool) -> None:
    """Emit the named ranges (``torch.profiler.record_function``) from now on, or stop."""
    global _ranges_on
    _ranges_on = bool(on)


def kernel_ranges_enabled() -> bool:
    return _ranges_on


def kernel_range(name: str) -> contextlib.AbstractContextManager[Any]:
    """A named profiler range when enabled, else a shared no-op context (a few hundred ns)."""
    return record_function(name) if _ranges_on else _NO_RANGE
