"""The three factors of the gap to ideal, as pure functions of measured inputs.

    gap = tau factor x kernel factor x overhead factor        (SpecPilot, Phase 0)

Each factor is >= 1 when something is lost to it, and the largest one is the next direction
(:func:`direction`). :func:`specpilot.costmodel.profile` measures the inputs and calls these;
nothing here measures, times or reads a model, so every factor can be checked by hand:

* :func:`tau_factor` - how many more tokens per step the throughput-optimal tree would commit
  than the plan does (exact replay, :mod:`.replay`);
* :func:`kernel_factor` - how much slower the kernels ran than their roofline floors
  (:mod:`.roofline`, :mod:`.measure`);
* :func:`overhead_factor` - how much of a step's wall time is spent outside the kernels
  (scheduling, syncs, copies, Python).
"""

from __future__ import annotations

from collections.abc import Mapping

FACTOR_NAMES = ("tau", "kernel", "overhead")


def tau_ratio(plan_tau: float, best_tau: float) -> float:
    """``best_tau / plan_tau``, unclamped (the report's ``tau_factor_raw``).

    ``plan_tau``: tokens committed per decode step by the plan in a real run (tau_actual);
    ``best_tau``: tau_opt(N*) of the exact replay at the throughput-optimal node budget N*.

    >>> tau_ratio(plan_tau=2.0, best_tau=3.0)
    1.5
    >>> tau_ratio(plan_tau=2.5, best_tau=2.0)  # the plan verifies more nodes than N*
    0.8
    """
    if plan_tau <= 0:
        raise ValueError(f"plan_tau must be > 0 (tokens per step), got {plan_tau}")
    return best_tau / plan_tau


def tau_factor(plan_tau: float, best_tau: float) -> float:
    """Tau factor: ``max(1, best_tau / plan_tau)`` (see :func:`tau_ratio` for the inputs).

    A ratio below 1 means the plan verifies more nodes than the throughput-optimal budget:
    acceptance is then not what limits it, and the factor is 1.

    Worked example: the plan commits 2.0 tokens per step; the oracle tree at N* = 8 would
    commit 3.0, so a better drafter or tree could gain 1.5x in tokens per step:

    >>> tau_factor(plan_tau=2.0, best_tau=3.0)
    1.5
    >>> tau_factor(plan_tau=2.5, best_tau=2.0)
    1.0
    """
    return max(1.0, tau_ratio(plan_tau, best_tau))


def kernel_factor(class_times: Mapping[str, float], floors: Mapping[str, float]) -> float:
    """Kernel factor: measured kernel time over roofline floor time, both summed over classes,
    each class counted at no less than its floor.

    ``class_times`` and ``floors`` map a kernel class ("qkv", "attention", ...) to its time per
    decode step, in the same unit. No floor at all gives infinity (nothing is known to be
    achievable). A class that ran faster than its floor (a GEMM above the floor's share of peak
    FLOP/s: SmolLM2's prefill on the fp32-activation kernels ran at 0.66x its floor on a 2-core
    EPYC; the profile notes it) has no gap left to close, and its lead must not hide the other
    classes' gaps: it counts at its floor, as does a class with a floor that was not measured.

    Worked example: qkv took 3 ms against a 1 ms floor, down 1 ms against 1 ms; 4 ms measured
    over 2 ms of floors; prefill 1 ms against a 2 ms floor counts 2 ms:

    >>> kernel_factor({"qkv": 3.0, "down": 1.0}, {"qkv": 1.0, "down": 1.0})
    2.0
    >>> kernel_factor({"qkv": 3.0, "prefill": 1.0}, {"qkv": 1.0, "prefill": 2.0})
    1.6666666666666667
    >>> kernel_factor({"drafter": 0.5}, {"drafter": 0.0})
    inf
    """
    floor = sum(floors.values())
    measured = sum(max(t, floors.get(k, 0.0)) for k, t in class_times.items())
    measured += sum(f for k, f in floors.items() if k not in class_times)
    return measured / floor if floor > 0 else float("inf")


def overhead_factor(wall_step_s: float, kernel_step_s: float) -> float:
    """Overhead factor: wall time per decode step (a run without the profiler) over the kernel
    time per step (the profiled run, profiler cost removed). Infinity without kernel time.

    Worked example: a step takes 12 ms of wall time, of which the kernels account for 8 ms; the
    other 4 ms are overhead, and removing them would make the step 1.5x faster:

    >>> overhead_factor(wall_step_s=0.012, kernel_step_s=0.008)
    1.5
    """
    return wall_step_s / kernel_step_s if kernel_step_s > 0 else float("inf")


def direction(factors: Mapping[str, float]) -> str:
    """Name of the largest factor (ties: tau before kernel before overhead).

    >>> direction({"tau": 1.5, "kernel": 3.0, "overhead": 1.1})
    'kernel'
    """
    return max(FACTOR_NAMES, key=lambda name: (factors[name], -FACTOR_NAMES.index(name)))
