"""Executors: where trials run. Both return futures of results and never of exceptions.

* :class:`LocalExecutor` (default) - N worker threads in the coordinator, each driving one trial
  subprocess at a time (:func:`~specpilot.pilot.trial.run_trial`). A crashed, hung or
  memory-exhausted child only ever produces a CRASH / TIMEOUT result; the worker thread is free
  again at once (OpenEvolve #246: one crashed worker must not break the pool).
* :class:`RayExecutor` (``--executor ray``) - one Ray actor per GPU, or per CPU slot, each
  running the same :func:`run_trial`; works with a local ``ray.init()``. An actor that dies is
  replaced and its trial is recorded as a CRASH.
On a CPU machine every trial shares one timing slot (a lock file): forcing may run in parallel,
timed requests never overlap any other trial's work (see :class:`~.proc.TimingSlot`).
Both take an ``abort`` event (the run's stop request, set on the first SIGINT): trials in flight
then end INTERRUPTED, their children killed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol

from specpilot.errors import ConfigError
from specpilot.pilot.proc import Abort
from specpilot.pilot.trial import (
    CRASH,
    INTERRUPTED,
    INTERRUPTED_REASON,
    ProfileJob,
    TrialJob,
    TrialResult,
    run_profile,
    run_trial,
)

ProfileOutcome = tuple[str, str, dict[str, Any] | None]


class Executor(Protocol):
    workers: int

    def submit(self, job: TrialJob) -> Future[TrialResult]: ...

    def profile(self, job: ProfileJob) -> ProfileOutcome: ...

    def shutdown(self) -> None: ...


def _guarded(fn: Callable[[Any], Any], job: Any, on_error: Callable[[str, str], Any],
             abort: Abort | None = None) -> Any:  # fmt: skip
    """``fn(job)``; an exception becomes ``on_error(status, reason)``: INTERRUPTED when the run
    was asked to stop (or the exception is a KeyboardInterrupt), else CRASH."""
    try:
        return fn(job)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt) or (abort is not None and abort.is_set()):
            return on_error(INTERRUPTED, INTERRUPTED_REASON.format(phase="the executor"))
        return on_error(CRASH, f"executor error: {type(e).__name__}: {e}")


class LocalExecutor:
    """Trials in subprocesses driven by a thread pool of ``workers``. With ``gpus``, each trial
    holds one GPU index for its duration (its children see only that GPU)."""

    def __init__(self, workers: int = 1, gpus: int = 0, abort: Abort | None = None) -> None:
        if workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {workers}")
        self.workers = workers
        self.abort = abort
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="specpilot-trial")
        self.gpus: queue.Queue[int] | None = None
        if gpus:
            self.gpus = queue.Queue()
            for i in range(gpus):
                self.gpus.put(i)

    def _on_device(self, fn: Callable[[Any], Any], job: Any) -> Any:
        if self.gpus is None:
            return fn(job)
        gpu = self.gpus.get()
        try:
            return fn(replace(job, env={**job.env, "CUDA_VISIBLE_DEVICES": str(gpu)}))
        finally:
            self.gpus.put(gpu)

    def submit(self, job: TrialJob) -> Future[TrialResult]:
        return self.pool.submit(
            _guarded,
            lambda j: self._on_device(lambda x: run_trial(x, self.abort), j),
            job,
            lambda status, why: TrialResult(job.key, status, why),
            self.abort,
        )

    def profile(self, job: ProfileJob) -> ProfileOutcome:
        return _guarded(
            lambda j: self._on_device(lambda x: run_profile(x, self.abort), j),
            job,
            lambda status, why: (status, why, None),
            self.abort,
        )

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class _TrialActor:
    """Runs trials inside a Ray worker process (the trusted side of the harness)."""

    def run(self, job: TrialJob) -> dict[str, Any]:
        return run_trial(job).to_json()

    def profile(self, job: ProfileJob) -> ProfileOutcome:
        return run_profile(job)

    def ping(self) -> bool:
        return True


class RayExecutor:
    """One actor per worker slot: ``gpus_per_worker`` GPUs (0 on CPU) and one CPU each."""

    def __init__(
        self, workers: int = 1, gpus_per_worker: float = 0.0, abort: Abort | None = None
    ) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError(
                "--executor ray needs Ray: pip install 'specpilot[ray]' (or pip install ray)"
            ) from None
        if workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {workers}")
        self.ray = ray
        self.abort = abort
        if not ray.is_initialized():
            ray.init(
                num_cpus=workers,
                include_dashboard=False,
                ignore_reinit_error=True,
                log_to_driver=False,
                configure_logging=False,
            )
        self.workers = workers
        self.env = _thread_env()
        self._remote = ray.remote(num_cpus=1, num_gpus=gpus_per_worker, max_restarts=0)(_TrialActor)
        self._free: queue.Queue[Any] = queue.Queue()
        for _ in range(workers):
            self._free.put(self._remote.remote())
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="specpilot-ray")

    def _call(self, method: str, job: Any) -> Any:
        job = replace(job, env={**self.env, **job.env})
        actor = self._free.get()
        try:
            ref = getattr(actor, method).remote(job)
            while not self.ray.wait([ref], timeout=0.2)[0]:
                if self.abort is not None and self.abort.is_set():
                    self.ray.kill(actor)  # its trial's children die with it (PDEATHSIG)
                    actor = self._remote.remote()
                    raise RuntimeError("interrupted")
            out = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as e:
            actor = self._remote.remote()  # replace the dead actor
            raise RuntimeError(f"Ray actor died: {e}") from None
        finally:
            self._free.put(actor)
        return out

    def submit(self, job: TrialJob) -> Future[TrialResult]:
        def run(j: TrialJob) -> TrialResult:
            return TrialResult.from_json(self._call("run", j))

        return self.pool.submit(_guarded, run, job,
                                lambda status, why: TrialResult(job.key, status, why),
                                self.abort)  # fmt: skip

    def profile(self, job: ProfileJob) -> ProfileOutcome:
        def run(j: ProfileJob) -> ProfileOutcome:
            status, reason, rep = self._call("profile", j)
            return status, reason, rep

        return _guarded(run, job, lambda status, why: (status, why, None), self.abort)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        while not self._free.empty():
            self.ray.kill(self._free.get_nowait())


def _thread_env() -> dict[str, str]:
    """The coordinator's thread settings for trial children started by Ray actors: Ray sets
    ``OMP_NUM_THREADS`` to an actor's CPU count (1), which would make every child - baseline and
    candidate alike - run single-threaded, unlike the local executor's."""
    import os

    import torch

    n = os.environ.get("OMP_NUM_THREADS") or str(torch.get_num_threads())
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS") or n}


def make_executor(kind: str, workers: int, device: str, abort: Abort | None = None) -> Executor:
    if kind == "local":
        if device.startswith("cuda"):
            import torch

            return LocalExecutor(workers, gpus=max(1, torch.cuda.device_count()), abort=abort)
        return LocalExecutor(workers, abort=abort)
    if kind == "ray":
        return RayExecutor(workers, 1.0 if device.startswith("cuda") else 0.0, abort)
    raise ConfigError(f"--executor must be local or ray, got {kind!r}")
