"""Planted mechanisms for the pilot's tests: each cheats, breaks or behaves in one known way.

Imported by the trusted parent (for ids, spaces) and, through ``ChildSpec.modules``, inside the
trial subprocess, where ``wrap_decode`` installs the behaviour. ``MECHANISMS`` lists them all.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from specpilot.mechanisms.base import Context, Param
from specpilot.plan import Plan

Decode = Callable[[list[int], Any], Any]


class Planted:
    """A mechanism whose effect is a ``wrap_decode`` hook (no plan fields change)."""

    id = "planted"
    description = "test mechanism"
    factor = "overhead"
    params: tuple[Param, ...] = ()

    def space(self, ctx: Context, plan: Plan) -> tuple[Param, ...]:
        return self.params

    def applicable(self, ctx: Context, plan: Plan) -> str | None:
        return None

    def apply(self, plan: Plan, params: Mapping[str, Any]) -> Plan:
        return plan.replace(options={**plan.options, self.id: dict(params)})

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        return decode


class Honest(Planted):
    """Changes nothing at run time; its parameter only says how long to sleep per request."""

    id = "honest"
    factor = "tau"
    params = (Param("delay_ms", "int", 0, low=0, high=100),)

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        delay = params.get("delay_ms", 0) / 1e3

        def run(ids: list[int], gen: Any) -> Any:
            if delay:
                time.sleep(delay)
            return decode(ids, gen)

        return run


class DropToken(Planted):
    id = "drop_token"
    factor = "tau"

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        def run(ids: list[int], gen: Any) -> Any:
            res = decode(ids, gen)
            if len(res.tokens) > 2:
                del res.tokens[len(res.tokens) // 2]
            return res

        return run


class StopEarly(Planted):
    id = "stop_early"
    factor = "tau"

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        def run(ids: list[int], gen: Any) -> Any:
            return decode(ids, dataclasses.replace(gen, max_new_tokens=gen.max_new_tokens // 2))

        return run


class SwapNearTie(Planted):
    """Changes the output token where the target's top-1/top-2 margin is smallest."""

    id = "swap_near_tie"
    factor = "kernel"

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        def run(ids: list[int], gen: Any) -> Any:
            res = decode(ids, dataclasses.replace(gen, record_margins=True))
            pos = min(range(len(res.margins)), key=res.margins.__getitem__)
            res.tokens[pos] = (res.tokens[pos] + 1) % 200 + 3
            return res

        return run


class CacheOutputs(Planted):
    """Caches outputs keyed on the prompt; a miss costs an extra 300 ms. Repeating a prompt to
    the same process would make it look fast."""

    id = "cache_outputs"

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        cache: dict[tuple[int, ...], Any] = {}
        disk = os.path.join(tempfile.gettempdir(), "planted-cache")

        def run(ids: list[int], gen: Any) -> Any:
            key = tuple(ids)
            if key in cache:
                return cache[key]
            res = decode(ids, gen)
            time.sleep(0.3)
            cache[key] = res
            with open(disk, "a") as f:
                f.write(f"{key}\n")
            return res

        return run


class BackgroundWork(Planted):
    """Starts a thread that spins forever (work outside the timed requests)."""

    id = "background_work"

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        def spin() -> None:
            x = 0
            while True:
                x += 1

        threading.Thread(target=spin, daemon=True).start()
        return decode


class PatchClock(Planted):
    """Slows the child's clocks 100x and sleeps 50 ms per request."""

    id = "patch_clock"

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        real_pc, real_t = time.perf_counter, time.time
        t0, w0 = real_pc(), real_t()
        time.perf_counter = lambda: t0 + (real_pc() - t0) / 100  # type: ignore[assignment]
        time.time = lambda: w0 + (real_t() - w0) / 100  # type: ignore[assignment]

        def run(ids: list[int], gen: Any) -> Any:
            time.sleep(0.05)
            return decode(ids, gen)

        return run


def _warmup(gen: Any) -> bool:
    """The child's setup warm-up decodes at most 8 tokens; the broken mechanisms below fire on
    real requests only, so their failure is a request's, not the setup's."""
    return gen.max_new_tokens <= 8


class Segfault(Planted):
    id = "segfault"

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        def run(ids: list[int], gen: Any) -> Any:
            if not _warmup(gen):
                os.kill(os.getpid(), signal.SIGSEGV)
            return decode(ids, gen)

        return run


class Hang(Planted):
    """Starts a grandchild in its own session (writes its pid to $PLANTED_PID_FILE) and hangs."""

    id = "hang"

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        def run(ids: list[int], gen: Any) -> Any:
            if _warmup(gen):
                return decode(ids, gen)
            p = subprocess.Popen(["sleep", "300"], start_new_session=True)
            path = os.environ.get("PLANTED_PID_FILE")
            if path:
                with open(path, "w") as f:
                    f.write(str(p.pid))
            time.sleep(3600)
            return decode(ids, gen)

        return run


class MemoryHog(Planted):
    id = "memory_hog"

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        def run(ids: list[int], gen: Any) -> Any:
            if _warmup(gen):
                return decode(ids, gen)
            hog = bytearray(64 << 30)
            return hog

        return run


MECHANISMS = (
    Honest(),
    DropToken(),
    StopEarly(),
    SwapNearTie(),
    CacheOutputs(),
    BackgroundWork(),
    PatchClock(),
    Segfault(),
    Hang(),
    MemoryHog(),
)


class SlowKernel(Planted):
    """A kernel-factor switch whose only effect is a 120 ms sleep per request unless ``fast``:
    the loop should find ``fast`` and keep it."""

    id = "slow_kernel"
    factor = "kernel"
    params = (Param("fast", "bool", False),)

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        def run(ids: list[int], gen: Any) -> Any:
            if not params.get("fast"):
                time.sleep(0.12)
            return decode(ids, gen)

        return run


class CrashKernel(Segfault):
    id = "crash_kernel"
    factor = "kernel"


LOOP_MECHANISMS = (SlowKernel(), CrashKernel())


class Sluggish(Planted):
    """A kernel-factor mechanism whose requests (not the setup warm-up) take 1 s each: a trial of
    it stays in flight long enough to be interrupted."""

    id = "sluggish"
    factor = "kernel"

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        def run(ids: list[int], gen: Any) -> Any:
            if not _warmup(gen):
                time.sleep(1.0)
            return decode(ids, gen)

        return run


class Impossible(Planted):
    """A kernel-factor switch that the scripted executor of the ceiling tests reports as far
    faster than the cost model allows (it never runs in a child there)."""

    id = "impossible"
    factor = "kernel"


SLOW_MECHANISMS = (Sluggish(),)
CEILING_MECHANISMS = (Impossible(),)
