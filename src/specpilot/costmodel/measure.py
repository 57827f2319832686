"""Measurements: kernel time per class from torch.profiler ranges, verify-step timing.

Kernel time. With :func:`specpilot.profiling.set_kernel_ranges` on, the model wraps each kernel
class in a ``record_function`` range (``qkv``, ``attention``, ``o_proj``, ``gate_up``, ``down``,
``lm_head``) and the engine wraps ``prefill`` and the drafter's ``propose`` (``drafter``). The
trace is read from the profiler's raw Kineto events (``prof.profiler.kineto_results``: one pass,
no Python event tree, so a few hundred thousand events cost tens of milliseconds). A class range
nested inside a ``prefill`` or ``drafter`` range belongs to that outer range (a draft model runs
the same module and emits the same names).

* CPU: a class's time is the wall duration of its ranges (CPU kernels are synchronous). A
  forward run as one op call (``specpilot::lean_run``) has no ranges inside: it times its
  classes itself with its clock (:func:`specpilot.profiling.clocking`) in the plan's run
  without the profiler (:attr:`ClassTimes.clocked`, per step of that run). The
  profiler itself adds a cost to every recorded event (a SmolLM2 step records ~5,000). It is
  calibrated on the workload itself: the profiled run's wall time per step minus the plain run's,
  divided by the events recorded per step, is the cost per event; each class then loses its
  events x that cost (:meth:`ClassTimes.corrected`). A tiny-op loop underestimates it (~0.3 us
  vs ~1 us per event measured on SmolLM2 here), so the workload is the reference.
* CUDA (not exercised by the CPU test suite): a class's time is the summed duration of the GPU
  kernels whose launch happened inside its ranges (matched through the Kineto correlation id).

Step cost. :func:`time_verify` times the engine's own verify step (``Engine.step``: tree mask,
target forward at width N + 1, argmax, greedy verification) on a chain of N nodes at a given
context length: the median of a few repeats after one warm-up call. The mask pattern does not change
the dense masked-attention cost, so a chain stands for any shape of N nodes.
"""

from __future__ import annotations

import bisect
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.autograd.profiler import profile as kineto_profile

from specpilot.engine import Engine
from specpilot.profiling import KERNEL_CLASSES, OUTER_RANGES, set_kernel_ranges
from specpilot.tree import DraftTree

RANGE_NAMES = frozenset((*KERNEL_CLASSES, *OUTER_RANGES))

R = TypeVar("R")


MAX_CORRECTION = 0.5
"""The largest share of a class's recorded time the profiler correction may remove."""


@dataclass
class ClassTimes:
    """Accumulated time per range name, as recorded (profiler overhead included)."""

    seconds: dict[str, float] = field(default_factory=dict)
    events: dict[str, int] = field(default_factory=dict)
    """Recorded events inside each class's ranges (the range itself and everything nested)."""
    all_events: int = 0
    """Every recorded CPU event, inside the ranges or not."""
    draft_o_proj: int = 0
    """``o_proj`` ranges inside ``drafter`` ranges: a draft model's forwards x its layers."""
    clocked: dict[str, float] = field(default_factory=dict)
    """Seconds per class a one-op forward timed itself in the run without the profiler (no
    events, nothing to correct; per step of that run, not of the profiled one)."""

    def add(self, other: ClassTimes) -> None:
        for k, v in other.seconds.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v
        for k, n in other.events.items():
            self.events[k] = self.events.get(k, 0) + n
        self.all_events += other.all_events
        self.draft_o_proj += other.draft_o_proj
        self.add_clocked(other.clocked)

    def add_clocked(self, clocked: dict[str, float]) -> None:
        for k, v in clocked.items():
            self.clocked[k] = self.clocked.get(k, 0.0) + v

    def corrected(self, per_event_s: float) -> dict[str, float]:
        """Seconds per class with ``per_event_s`` removed for every event recorded inside, but
        never more than :data:`MAX_CORRECTION` of a class's recorded time: the cost per event is
        an average over the whole step (inflated when the machine stalls during the profiled
        run), and a class of few fast ops (the fixed attention kernel) could otherwise read 0."""
        return {
            k: s - min(self.events.get(k, 0) * per_event_s, MAX_CORRECTION * s)
            for k, s in self.seconds.items()
        }


@contextmanager
def _ranges() -> Iterator[None]:
    set_kernel_ranges(True)
    try:
        yield
    finally:
        set_kernel_ranges(False)


def _quiet_kineto() -> None:
    """Kineto prints a line on every trace start/stop; level 6 silences it (read at its first
    use, so this must run before the first profiler session). A user's own setting wins."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def profiled(fn: Callable[[], R], device: torch.device) -> tuple[R, ClassTimes]:
    """Run ``fn`` with kernel ranges on under the Kineto profiler; its result and the class
    times. The autograd profiler itself (what torch.profiler.profile wraps, same events): the
    wrapper's start imports torch._inductor, seconds in every profiling process."""
    _quiet_kineto()
    cuda = device.type == "cuda"
    with _ranges(), kineto_profile(use_device="cuda" if cuda else None, use_kineto=True) as prof:
        out = fn()
    events = prof.kineto_results.events()
    return out, collect(events, cuda)


def collect(events: Any, cuda: bool) -> ClassTimes:
    """Class times from raw Kineto events (see the module docstring)."""
    cpu = [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU]
    named = sorted(
        (e for e in cpu if e.is_user_annotation() and e.name() in RANGE_NAMES),
        key=lambda e: e.start_ns(),
    )
    outer = [(e.start_ns(), e.end_ns(), e.name()) for e in named if e.name() in OUTER_RANGES]
    outer_starts = [s for s, _, _ in outer]

    def owner(t0: int, t1: int) -> str | None:
        """The outer range containing [t0, t1], if any (outer ranges never overlap)."""
        i = bisect.bisect_right(outer_starts, t0) - 1
        return outer[i][2] if i >= 0 and outer[i][1] >= t1 else None

    top: list[tuple[str, int, int]] = []  # (name, start, end) of ranges that own their time
    res = ClassTimes(all_events=len(cpu))
    for e in named:
        s, t, name = e.start_ns(), e.end_ns(), e.name()
        if name in KERNEL_CLASSES and (host := owner(s, t)) is not None:
            res.draft_o_proj += int(name == "o_proj" and host == "drafter")
            continue
        top.append((name, s, t))
    if not cuda:
        starts = sorted(e.start_ns() for e in cpu)
        for name, s, t in top:
            n = bisect.bisect_right(starts, t) - bisect.bisect_left(starts, s)
            res.seconds[name] = res.seconds.get(name, 0.0) + (t - s) * 1e-9
            res.events[name] = res.events.get(name, 0) + n
        return res
    launch = {e.correlation_id(): e.start_ns() for e in cpu}
    top.sort(key=lambda x: x[1])
    top_starts = [s for _, s, _ in top]
    for e in events:
        if e.device_type() != torch.autograd.DeviceType.CUDA or e.is_user_annotation():
            continue
        t0 = launch.get(e.linked_correlation_id())
        if t0 is None:
            continue
        i = bisect.bisect_right(top_starts, t0) - 1
        if i < 0 or top[i][2] < t0:  # launched outside every range: glue, not a class
            continue
        name = top[i][0]
        res.seconds[name] = res.seconds.get(name, 0.0) + e.duration_ns() * 1e-9
        res.events[name] = res.events.get(name, 0) + 1
    return res


def profiler_cost_per_event(
    wall_step_s: float, profiled_step_s: float, profiled_steps: int, events: int
) -> float:
    """Seconds the CPU profiler adds per recorded event: the profiled run's extra wall time per
    step over the plain run's, times its steps, over the events it recorded (0 without events).

    >>> profiler_cost_per_event(0.010, 0.015, profiled_steps=100, events=500_000)
    1e-06
    """
    if events <= 0:
        return 0.0
    return max(0.0, profiled_step_s - wall_step_s) * profiled_steps / events


def time_verify(
    engine: Engine, n_nodes: int, cache_len: int, repeats: int = 3, token: int = 0
) -> float:
    """Median seconds of one verify step of ``n_nodes`` (a chain) at ``cache_len`` cached keys."""
    tree = DraftTree.chain([token] * n_nodes) if n_nodes else DraftTree.empty()
    engine._ensure_cache(cache_len + n_nodes + 2)
    sync = torch.cuda.synchronize if engine.model.device.type == "cuda" else None
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        engine.step(token, cache_len, tree)
        if sync is not None:
            sync()
        if i:
            times.append(time.perf_counter() - t)
    return statistics.median(times)
