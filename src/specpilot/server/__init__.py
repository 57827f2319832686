"""``specpilot serve``: an OpenAI-compatible HTTP server over the batched engine.

:mod:`~specpilot.server.app` (FastAPI routes and errors),
:mod:`~specpilot.server.completions` (one request from body to OpenAI response or stream),
:mod:`~specpilot.server.logs` (request ids, logging),
:mod:`~specpilot.server.scheduler` (continuous batching on one engine thread),
:mod:`~specpilot.server.metrics` (Prometheus), :mod:`~specpilot.server.protocol` (request
validation).
"""

from __future__ import annotations

from specpilot.server.app import create_app, serve_in_main
from specpilot.server.scheduler import Scheduler

__all__ = ["Scheduler", "create_app", "serve_in_main"]
