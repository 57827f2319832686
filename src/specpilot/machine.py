"""This machine, as the measured caches key and trust it: the CPU's model and instruction sets,
the cache root, and the load of other processes while a measurement runs.

Measurements that are kept on disk (the cost model's hardware peaks,
:mod:`specpilot.costmodel.hardware`; the goodput cost curve, :mod:`specpilot.goodput.curve`) are
only worth keeping when taken on a quiet machine: :func:`sample_load` runs a measurement and
returns the CPU cores other processes used meanwhile (``/proc/stat`` busy time minus this
process's own), and :func:`load_limit` is the most that still counts as quiet.

:func:`cache_root` is the directory those caches live in: the parent of ``$SPECPILOT_CACHE``
(which names the converted-model cache, ``.../specpilot/models``), else ``~/.cache/specpilot``.
:func:`isa_level` classes the CPU for the native kernels and the memory's contexts
(``amx``: AVX-512 VNNI with AMX-TILE/INT8, ``avx512_vnni``, ``avx512``, ``avx2``, ``portable``).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

CACHE_ENV = "SPECPILOT_CACHE"

ISA_FLAGS = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "avx2", "fma", "f16c", "neon",
             "asimd", "sve")  # fmt: skip
"""The /proc/cpuinfo flags that change which kernels run (and so their speed)."""

CpuSample = tuple[float, float, float]
R = TypeVar("R")


def cache_root() -> Path:
    """Where measured caches live: the parent of ``$SPECPILOT_CACHE``, else
    ``~/.cache/specpilot``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser().parent
    return Path.home() / ".cache" / "specpilot"


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    return (
        _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown cpu"
    )


def cpu_isa() -> str:
    """The instruction sets of :data:`ISA_FLAGS` this CPU has, ``+``-joined (the machine type
    when ``/proc/cpuinfo`` says nothing)."""
    flags = set((_cpuinfo_field("flags") or _cpuinfo_field("Features") or "").split())
    have = [f for f in ISA_FLAGS if f in flags]
    return "+".join(have) if have else platform.machine() or "unknown"


ISA_LEVELS = ("amx", "avx512_vnni", "avx512", "avx2", "portable")
"""The kernel ISA classes memory contexts are keyed by, best first."""


def isa_level(flags: str | None = None) -> str:
    """This CPU's kernel ISA class (one of :data:`ISA_LEVELS`) from its ``/proc/cpuinfo`` flags
    (``flags``: a flags line to classify instead of this machine's).

    >>> isa_level("fpu avx avx2 fma f16c avx512f avx512_vnni")
    'avx512_vnni'
    >>> isa_level("avx2 fma f16c avx512f avx512_vnni amx_tile amx_int8")
    'amx'
    >>> isa_level("fpu avx avx2 fma f16c"), isa_level("fpu sse2"), isa_level("avx2")
    ('avx2', 'portable', 'portable')
    """
    line = (_cpuinfo_field("flags") or "") if flags is None else flags
    have = set(line.split())
    if not {"avx2", "fma", "f16c"} <= have:  # what the AVX2 kernels need
        return "portable"
    if "avx512f" not in have:
        return "avx2"
    if "avx512_vnni" not in have:
        return "avx512"
    return "amx" if {"amx_tile", "amx_int8"} <= have else "avx512_vnni"


def cpu_times() -> CpuSample | None:
    """(monotonic s, busy CPU-seconds of the whole machine, CPU-seconds of this process), from
    ``/proc/stat`` (user, nice, system, irq, softirq, steal); None where there is none."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        ticks = [int(x) for x in first[1:9]]
    except (OSError, ValueError):
        return None
    if not first or first[0] != "cpu" or len(ticks) < 8:
        return None
    own = os.times()
    busy = (sum(ticks[:3]) + sum(ticks[5:8])) / os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy, own.user + own.system


def other_load(start: CpuSample | None, end: CpuSample | None) -> float | None:
    """Mean CPU cores used by other processes between two samples (None: unknown).

    >>> other_load((0.0, 10.0, 1.0), (2.0, 13.0, 2.0))  # 3 busy CPU-s in 2 s, 1 of them ours
    1.0
    """
    if start is None or end is None or end[0] <= start[0]:
        return None
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0]))


def load_limit() -> float:
    """Cores of other work above which a measurement is not trusted (0.3, or 10% of the CPUs)."""
    return max(0.3, 0.1 * (os.cpu_count() or 1))


def sample_load(
    fn: Callable[[], R],
    min_s: float = 0.25,
    times: Callable[[], CpuSample | None] = cpu_times,
) -> tuple[R, float | None]:
    """``fn()`` and the other processes' load while it ran, sampled over at least ``min_s``."""
    start, t0 = times(), time.monotonic()
    out = fn()
    rest = min_s - (time.monotonic() - t0)
    if rest > 0:
        time.sleep(rest)
    return out, other_load(start, times())
