"""``specpilot serve``: an OpenAI-compatible server (FastAPI + uvicorn) over the batched engine.

Concurrent requests are continuously batched (:mod:`specpilot.server.scheduler`); the verify
budget shrinks with the batch (:class:`specpilot.batch.VerifyBudget`). Binds 127.0.0.1 unless
told otherwise. Logs go to stderr at ``--log-level`` (default info), one line per request and
every engine-thread failure with its traceback, each with the request id that the response's
``x-request-id`` header carries.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from specpilot.cli import _drafter_args, _model_args, _plan_args
from specpilot.errors import ConfigError

DEFAULT_PORT = 8000


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics; concurrent requests are continuously batched into the speculative engine.",
    )
    _model_args(p)
    _drafter_args(p)
    _plan_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    p.add_argument(
        "--max-len",
        type=int,
        default=2048,
        help="cache slots per sequence: prompt + max_tokens + draft nodes (default: %(default)s)",
    )
    p.add_argument(
        "--budget-table",
        default=None,
        help="draft nodes per sequence by batch size, e.g. '1:16,2:8,4:6,8:4,16:2'",
    )
    p.add_argument(
        "--min-gain",
        type=float,
        default=0.0,
        help="verify only draft nodes whose path acceptance probability is at least this",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: --model)"
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server and uvicorn log level (default: %(default)s)",
    )
    return p


def parse_budget_table(text: str) -> tuple[tuple[int, int], ...]:
    """``'1:16,4:8'`` -> ((1, 16), (4, 8))."""
    try:
        pairs = [part.split(":") for part in text.split(",") if part.strip()]
        return tuple((int(b), int(n)) for b, n in pairs)
    except ValueError:
        raise ConfigError(f"--budget-table must look like '1:16,4:8', got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from specpilot.server import Scheduler, create_app, serve_in_main
        from specpilot.server.logs import configure_logging
        from specpilot.server.metrics import ServerMetrics
    except ImportError as e:
        raise ConfigError(
            f"specpilot serve needs its extra dependencies ({e.name} is missing): "
            "pip install -e '.[serve]'"
        ) from None
    from specpilot.batch import BatchConfig, BatchEngine, VerifyBudget
    from specpilot.cli import _setup

    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    if args.max_batch < 1:
        raise ConfigError(f"--max-batch must be >= 1, got {args.max_batch}")
    table = parse_budget_table(args.budget_table) if args.budget_table else None
    bcfg = BatchConfig(
        max_batch=args.max_batch,
        max_len=args.max_len,
        budget=VerifyBudget(table) if table else VerifyBudget(),
        min_gain=args.min_gain,
    )
    if args.drafter and len(args.drafter) > 1:
        raise ConfigError("serve takes one --drafter")
    if args.tree and len(args.tree) > 1:
        raise ConfigError("serve takes one --tree")
    loaded, engine, candidates, _ = _setup(args)  # flags or --plan, through the plan runtime
    cand = candidates[0] if candidates else None
    make = cand.make_drafter if cand else None
    if args.plan and not table:  # the plan's batch_budget table, when it has one
        from specpilot.bench_batch import plan_budget

        budget = plan_budget(args.plan, cand.spec.max_nodes if cand else 0)
        bcfg = replace(bcfg, budget=budget or bcfg.budget)
    tok = loaded.tokenizer
    beng = BatchEngine(loaded.model, engine.cfg, bcfg, eos_ids=tok.eos_ids, detok=tok.decode)
    beng.prepare(drafting=make is not None)  # the cache and the cost curve before /health is up
    sched = Scheduler(beng, make, cand.spec if cand else None, ServerMetrics(), own_thread=False)
    name = args.served_model_name or args.model
    app = create_app(sched, tok, name, context_len=beng.max_len - 1)
    configure_logging(args.log_level)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    serve_in_main(sched, uvicorn.Server(config))  # the engine here, in the main thread
    return 0
