"""Prometheus metrics of the server (prometheus-client), in a registry of their own.

tau is the mean tokens committed per sequence per target step (accepted + bonus); acceptance at
depth d is the fraction of sequence-steps whose accepted path reached depth d.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specpilot.batch import StepStats

MAX_DEPTH = 16
"""Depths reported by ``specpilot_acceptance_by_depth``."""


class ServerMetrics:
    """Counters, gauges and histograms the scheduler updates; ``render()`` is the /metrics body."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter(
            "specpilot_prompt_tokens", "Prompt tokens prefilled", registry=r
        )
        self.generated_tokens = Counter(
            "specpilot_generation_tokens", "Tokens generated (committed)", registry=r
        )
        self.requests = Counter(
            "specpilot_requests", "Finished requests by outcome", ["outcome"], registry=r
        )
        self.queue_depth = Gauge(
            "specpilot_queue_depth", "Requests waiting for a batch row", registry=r
        )
        self.running = Gauge("specpilot_running_requests", "Requests being decoded", registry=r)
        self.steps = Counter("specpilot_steps", "Batched target steps", registry=r)
        self.seq_steps = Counter(
            "specpilot_sequence_steps", "Sequence-steps (one sequence in one step)", registry=r
        )
        self.accepted = Counter(
            "specpilot_accepted_tokens", "Accepted draft tokens (bonus not counted)", registry=r
        )
        self.draft_nodes = Counter("specpilot_draft_nodes", "Draft nodes verified", registry=r)
        self.tau = Gauge(
            "specpilot_tau", "Mean tokens per sequence per step (accepted + bonus)", registry=r
        )
        self.acceptance = Gauge(
            "specpilot_acceptance_by_depth",
            "Fraction of sequence-steps whose accepted path reached this depth",
            ["depth"],
            registry=r,
        )
        self._timings(r)
        self.batch_size = Histogram(
            "specpilot_step_batch_size",
            "Sequences per batched step",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.latency = Histogram(
            "specpilot_request_latency_seconds",
            "Request latency, arrival to last token",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120),
            registry=r,
        )
        self.ttft = Histogram(
            "specpilot_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )
        self.goodput_predicted = Gauge(
            "specpilot_goodput_predicted_verify_seconds",
            "Goodput budget: predicted verify time of the last step",
            registry=r,
        )
        self.goodput_measured = Gauge(
            "specpilot_goodput_verify_seconds",
            "Goodput budget: measured verify time of the last step",
            registry=r,
        )
        self.goodput_nodes = Gauge(
            "specpilot_goodput_nodes", "Goodput budget: draft nodes chosen for the last step",
            registry=r,
        )
        self._lock = threading.Lock()
        self._depth_hits = [0] * MAX_DEPTH
        self._seq_steps = 0
        self._committed = 0

    def _timings(self, r: CollectorRegistry) -> None:
        """Where a step's and an admission's time goes."""
        self.step_seconds = Histogram(
            "specpilot_step_seconds",
            "Wall time of one batched step (draft, verify, accept, commit)",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
            registry=r,
        )
        self.draft_seconds = Counter(
            "specpilot_draft_seconds",
            "Time of the steps' drafting and node choice (before the verify forward), by what "
            "drafted: none, full (the drafter, every step) or probe (a draft while plain decoding "
            "wins), each maybe +cheap (a tiered drafter's cheap part)",
            ["drafted"],
            registry=r,
        )
        self.drafted_steps = Counter(
            "specpilot_drafted_steps", "Batched steps by what drafted", ["drafted"], registry=r
        )
        self.verify_seconds = Counter(
            "specpilot_verify_seconds",
            "Time of the steps' verify forward, acceptance and cache commit",
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "specpilot_prefill_seconds",
            "Wall time of one request's admission (prefill and the drafter's start)",
            buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
            registry=r,
        )

    def observe_step(self, st: StepStats) -> None:
        self.steps.inc()
        self.seq_steps.inc(st.batch)
        self.accepted.inc(sum(st.accepted))
        self.draft_nodes.inc(st.nodes)
        self.step_seconds.observe(st.seconds)
        self.draft_seconds.labels(drafted=st.drafted).inc(st.draft_s)
        self.drafted_steps.labels(drafted=st.drafted).inc()
        self.verify_seconds.inc(st.verify_s)
        self.batch_size.observe(st.batch)
        if st.predicted_verify_s is not None:
            self.goodput_predicted.set(st.predicted_verify_s)
            self.goodput_measured.set(st.verify_s)
            self.goodput_nodes.set(st.nodes)
        with self._lock:
            self._seq_steps += st.batch
            self._committed += sum(st.accepted) + st.batch
            for a in st.accepted:
                for d in range(min(a, MAX_DEPTH)):
                    self._depth_hits[d] += 1
            self.tau.set(self._committed / self._seq_steps)
            for d, hits in enumerate(self._depth_hits):
                self.acceptance.labels(depth=str(d + 1)).set(hits / self._seq_steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
