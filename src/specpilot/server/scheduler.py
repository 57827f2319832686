"""Continuous batching: one thread owns the :class:`~specpilot.batch.BatchEngine`.

That thread is a worker of the scheduler's own (:meth:`Scheduler.start`, for embedding the app)
or the caller's (:meth:`Scheduler.run`): ``specpilot serve`` runs the engine in the process's
main thread and HTTP in another, because libgomp (torch's OpenMP) keeps one thread pool per
thread that starts parallel regions and, once it manages more threads than there are cores,
lets them spin only ~100 iterations before sleeping: with the model loaded in the main thread
(its pool) and the engine stepping in a worker (a second one), every parallel region waited for
sleeping threads, and a batch-8 step took 19-20 ms instead of 11-12 ms on a 2-core EPYC.

Request handlers (on the asyncio event loop) submit jobs; before every batched step the worker
drops cancelled jobs, admits waiting jobs into free rows (prefill), then runs one step for all
running sequences. New tokens go back to each job's asyncio queue as ``Event`` objects, those of
a step (or an admission) together: one ``loop.call_soon_threadsafe`` per event loop. The engine
thread never raises across the thread boundary: a failing request gets an ``error`` event (a 500
for its client), the traceback goes to the ``specpilot.server.scheduler`` logger with the request
ids, and the engine keeps serving the others.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specpilot.batch import BatchEngine, BatchRequest, Slot
from specpilot.drafters.base import Drafter
from specpilot.engine import GenerationConfig, GenerationResult, frozen_heap
from specpilot.server.metrics import ServerMetrics
from specpilot.tree import TreeSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    """What a job's queue receives: new tokens, the final result, or an error."""

    kind: str
    """"tokens", "done" or "error"."""
    tokens: tuple[int, ...] = ()
    result: GenerationResult | None = None
    error: str = ""


@dataclass
class Job:
    """One request travelling between the event loop and the worker."""

    prompt: list[int]
    gen: GenerationConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    slot: Slot | None = None
    request_id: str = "-"
    """The HTTP request's id (:mod:`specpilot.server.logs`), for the engine thread's logs."""

    def post(self, ev: Event) -> None:
        """Deliver ``ev`` on the job's event loop (callable from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the loop is closed: the client is gone
            self.cancelled.set()


class Scheduler:
    """Owns the worker thread; ``submit`` and ``cancel`` are safe from any thread."""

    def __init__(
        self,
        engine: BatchEngine,
        make_drafter: Callable[[], Drafter | None] | None = None,
        spec: TreeSpec | None = None,
        metrics: ServerMetrics | None = None,
        own_thread: bool = True,
    ) -> None:
        """``own_thread``: :meth:`start` runs the engine in a worker thread of the scheduler's;
        False: :meth:`start` does nothing and the caller runs :meth:`run` in its own thread
        (the one that loaded the model: see the module's docstring)."""
        self.engine = engine
        self.own_thread = own_thread
        self.drafting = make_drafter is not None
        self.make_drafter = make_drafter or (lambda: None)
        self.spec = spec or TreeSpec(kind="chain")
        self.metrics = metrics or ServerMetrics()
        self._inbox: queue.Queue[Job] = queue.Queue()
        self._waiting: deque[Job] = deque()
        self._running: dict[int, Job] = {}
        """id(slot) -> job."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._driven = threading.Event()
        """Set while :meth:`run` serves in the caller's thread."""
        self._outbox: list[tuple[Job, Event]] = []
        """Events for the jobs' event loops, delivered together by :meth:`_flush`."""

    # -- called from the event loop ------------------------------------------------------------

    def request(self, prompt: list[int], gen: GenerationConfig) -> BatchRequest:
        """The batch request for ``prompt`` (raises ContextLengthError if it cannot fit)."""
        req = BatchRequest(prompt, gen, None, self.spec)
        self.engine.check(req, drafted=self.drafting)
        return req

    def submit(self, job: Job) -> None:
        self.request(job.prompt, job.gen)
        self._inbox.put(job)
        self.metrics.queue_depth.inc()

    def cancel(self, job: Job) -> None:
        job.cancelled.set()

    def start(self) -> None:
        """Start the worker thread (``own_thread``; else nothing: :meth:`run` serves)."""
        if self.own_thread and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="specpilot-engine", daemon=True)
            self._thread.start()

    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        """Serve in the calling thread until :meth:`stop` or ``until()`` (asked between steps
        and every 50 ms while idle); the requests still waiting or running then get an error."""
        if self.own_thread:
            raise RuntimeError("this scheduler runs its own thread (own_thread=True)")
        self._driven.set()
        try:
            self._loop(until)
        finally:
            self._driven.clear()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called."""
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()) or self._driven.is_set()

    # -- the worker ----------------------------------------------------------------------------

    def _loop(self, until: Callable[[], bool] = lambda: False) -> None:
        with frozen_heap():  # the loaded model's objects out of every collection's walk
            self._serve(until)

    def _serve(self, until: Callable[[], bool]) -> None:
        while not self._stop.is_set() and not until():
            idle = not self._waiting and not self.engine.slots
            try:
                job = self._inbox.get(timeout=0.05) if idle else self._inbox.get_nowait()
                self._waiting.append(job)
                while True:
                    self._waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            try:
                self._drop_cancelled()
                self._admit()
                if self.engine.slots:
                    self._step()
            except Exception as e:  # a bug outside one request: fail them all, keep serving
                ids = [j.request_id for j in (*self._waiting, *self._running.values())]
                logger.exception("engine loop failed; failing requests %s", ids)
                self._fail_all(f"{type(e).__name__}: {e}")
            finally:
                self._flush()
        for job in [*self._waiting, *self._running.values()]:
            job.post(Event("error", error="the server is shutting down"))

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._waiting if j.cancelled.is_set()]:
            self._waiting.remove(job)
            self.metrics.queue_depth.dec()
            self.metrics.requests.labels(outcome="cancelled").inc()
        for key, job in list(self._running.items()):
            if job.cancelled.is_set() and job.slot is not None:
                self.engine.remove(job.slot)
                del self._running[key]
                self.metrics.running.dec()
                self.metrics.requests.labels(outcome="cancelled").inc()

    def _admit(self) -> None:
        while self._waiting and self.engine.free > 0:
            job = self._waiting.popleft()
            self.metrics.queue_depth.dec()
            req = BatchRequest(job.prompt, job.gen, None, self.spec, on_tokens=self._on_tokens(job))
            try:
                t0 = time.perf_counter()
                req.drafter = self.make_drafter()
                slot = self.engine.add(req)
                self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
            except Exception as e:  # one bad request must not stop the server
                logger.exception("request could not be admitted", extra=_rid(job))
                self._send(job, Event("error", error=f"{type(e).__name__}: {e}"))
                self.metrics.requests.labels(outcome="error").inc()
                continue
            self.metrics.prompt_tokens.inc(len(job.prompt))
            job.slot = slot
            if slot.done:
                self._finish(job)
            else:
                self._running[id(slot)] = job
                self.metrics.running.inc()
            self._flush()  # its first token now, not after the next prefill or step

    def _on_tokens(self, job: Job) -> Callable[[list[int]], None]:
        def push(toks: list[int]) -> None:
            if job.t_first is None:
                job.t_first = time.perf_counter()
                self.metrics.ttft.observe(job.t_first - job.t_arrival)
            self.metrics.generated_tokens.inc(len(toks))
            self._send(job, Event("tokens", tuple(toks)))

        return push

    def _step(self) -> None:
        try:
            finished, stats = self.engine.step()
        except Exception as e:  # fail the running requests, keep serving new ones
            ids = [j.request_id for j in self._running.values()]
            logger.exception("batched step failed; failing requests %s", ids)
            for job in self._running.values():
                if job.slot is not None:
                    self.engine.remove(job.slot)
                self._send(job, Event("error", error=f"{type(e).__name__}: {e}"))
                self.metrics.requests.labels(outcome="error").inc()
            self.metrics.running.set(0)
            self._running.clear()
            return
        self.metrics.observe_step(stats)
        for slot in finished:
            job = self._running.pop(id(slot), None)
            if job is not None:
                self.metrics.running.dec()
                self._finish(job)

    def _fail_all(self, error: str) -> None:
        """Every waiting and running job gets ``error``; their rows leave the batch."""
        for job in [*self._waiting, *self._running.values()]:
            if job.slot is not None:
                try:
                    self.engine.remove(job.slot)
                except Exception:  # the batch may be what broke; the rows go with it
                    logger.exception("could not free a failed request's row", extra=_rid(job))
            self._send(job, Event("error", error=error))
            self.metrics.requests.labels(outcome="error").inc()
        self.metrics.queue_depth.dec(len(self._waiting))
        self.metrics.running.dec(len(self._running))
        self._waiting.clear()
        self._running.clear()

    def _finish(self, job: Job) -> None:
        assert job.slot is not None
        self.metrics.latency.observe(time.perf_counter() - job.t_arrival)
        self.metrics.requests.labels(outcome="ok").inc()
        self._send(job, Event("done", result=job.slot.res))

    def _send(self, job: Job, ev: Event) -> None:
        """Queue ``ev`` for ``job``; :meth:`_flush` delivers it."""
        self._outbox.append((job, ev))

    def _flush(self) -> None:
        """Deliver the queued events, in order, with one wake-up of each event loop (a wake-up
        per event, a write to the loop's self-pipe, took ~3% of the engine thread's time on a
        loaded 2-core server: 8 a step at batch 8)."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = defaultdict(list)
        for job, ev in self._outbox:
            by_loop[job.loop].append((job, ev))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: its clients are gone
                for job, _ in items:
                    job.cancelled.set()


def _deliver(items: list[tuple[Job, Event]]) -> None:
    """On the jobs' event loop: each event into its job's queue."""
    for job, ev in items:
        job.events.put_nowait(ev)


def _rid(job: Job) -> dict[str, str]:
    """``extra`` of a log record about ``job`` (its request id)."""
    return {"request_id": job.request_id}
