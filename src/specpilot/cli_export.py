"""``specpilot export --plan P --to vllm|sglang``: print a plan as another engine's flags.

Renders :func:`specpilot.export.export_plan`; found by :mod:`specpilot.cli` like every
``cli_*`` module (``add_parser(sub)`` and ``run(args)``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specpilot.export import TARGETS, export_plan


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export",
        help="print a plan as vLLM / SGLang speculative decoding flags",
        description="Print the vLLM or SGLang configuration equivalent to a plan, which flags "
        "are approximate, and what does not translate.",
    )
    p.add_argument("--plan", required=True, help="a plan file or a run directory (plan.json)")
    p.add_argument("--to", required=True, choices=TARGETS, help="target engine")
    p.add_argument("--model", default="MODEL", help="model path or id to put in the command")
    p.add_argument(
        "--draft-model", default=None, help="draft model path or id, if the plan uses one"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a command")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def run(args: argparse.Namespace) -> int:
    from specpilot.plan import load_plan
    from specpilot.runtime import check_plan_drafter, plan_options

    plan = load_plan(args.plan)
    plan_options(plan)  # unknown mechanisms / bad options are errors here too
    check_plan_drafter(plan.drafter)  # as bench would reject it
    out = export_plan(plan, args.to, draft_model=args.draft_model)
    if args.json:
        sys.stdout.write(json.dumps(out.to_json(), indent=2) + "\n")
    else:
        sys.stdout.write(out.render(args.model))
    return 0
