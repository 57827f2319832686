"""Named profiler ranges around the kernel classes of a forward (read by the cost model).

With :func:`set_kernel_ranges` on, each kernel class of :data:`KERNEL_CLASSES` runs in a
``torch.profiler.record_function`` range of its name (:mod:`specpilot.costmodel.measure` sums
them); off (the default) the ranges are one shared no-op context and nothing else changes.

A forward that runs as one op call (``specpilot::lean_run``, :mod:`specpilot.kernels.stack`)
emits no ranges inside; with the class clock on (:func:`clocking`, a run without the profiler,
whose per-event cost would land in the op's sections) it times its own classes instead
(:func:`class_clock`, two ``steady_clock`` reads a section) and :func:`add_clock` adds them to
:data:`clocked`. A call inside an outer range (``prefill``, ``drafter``: :data:`OUTER_RANGES`) is
that range's time, so it is not clocked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import record_function

KERNEL_CLASSES = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head")
"""Named profiler ranges of one forward (the cost model's kernel classes). ``qkv`` holds the input
RMSNorm, the q/k/v projection, q/k norms and RoPE; ``attention`` the cache write and SDPA;
``gate_up`` the post-attention RMSNorm, the gate/up projection and SiLU x up; ``lm_head`` the
final RMSNorm and the LM head. Residual adds and the embedding gather stay outside (glue), except
that with the row ops on (:mod:`specpilot.kernels.rowops`) the post-attention residual add is one
op with the norm in ``gate_up``."""
OUTER_RANGES = ("prefill", "drafter")
"""Ranges whose whole time is one class of their own (class ranges inside belong to them)."""

_ranges_on = False
_clock_on = False
_outer = 0
"""Outer ranges open now (nested calls are theirs, never clocked)."""
_NO_RANGE = contextlib.nullcontext()
clocked: dict[str, float] = {}
"""Seconds per kernel class timed by op clocks (:func:`add_clock`) in the current or last
:func:`clocking` block."""


def set_kernel_ranges(on: bool) -> None:
    """Emit the named ranges (``torch.profiler.record_function``) from now on, or stop."""
    global _ranges_on
    _ranges_on = bool(on)


def kernel_ranges_enabled() -> bool:
    return _ranges_on


@contextlib.contextmanager
def clocking() -> Iterator[dict[str, float]]:
    """Class clocks on for the body (:func:`class_clock`); yields :data:`clocked`, emptied at
    the start and filled by the body's op calls."""
    global _clock_on
    clocked.clear()
    _clock_on = True
    try:
        yield clocked
    finally:
        _clock_on = False


@contextlib.contextmanager
def _outer_range(name: str) -> Iterator[None]:
    global _outer
    _outer += 1
    try:
        with record_function(name) if _ranges_on else _NO_RANGE:
            yield
    finally:
        _outer -= 1


def kernel_range(name: str) -> contextlib.AbstractContextManager[Any]:
    """A named profiler range when enabled (an outer one also counted while the clock is on),
    else a shared no-op context (a few hundred ns)."""
    if not (_ranges_on or _clock_on):
        return _NO_RANGE
    if name in OUTER_RANGES:
        return _outer_range(name)
    return record_function(name) if _ranges_on else _NO_RANGE


def class_clock() -> torch.Tensor | None:
    """A zeroed float64 clock of one slot per kernel class for an op that times its own classes
    (:func:`add_clock` afterwards), or None: the clock is off or an outer range is open."""
    if not _clock_on or _outer:
        return None
    return torch.zeros(len(KERNEL_CLASSES), dtype=torch.float64)


def add_clock(clock: torch.Tensor | None) -> None:
    """Add an op's clock (:func:`class_clock`) to :data:`clocked`."""
    if clock is None:
        return
    for name, s in zip(KERNEL_CLASSES, clock.tolist(), strict=True):
        clocked[name] = clocked.get(name, 0.0) + s
