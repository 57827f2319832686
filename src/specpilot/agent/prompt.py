"""What an agent is told each round: the rules, the cost-model report, the current plan, the
Mechanism protocol and example mechanisms (their real source), the mechanisms it can tune,
relevant memory entries and its own past failures with their reasons."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specpilot.agent.static import ALLOWED_IMPORTS, FORBIDDEN_NAMES

EXAMPLES = ("chain_length.py", "adaptive_draft.py", "static_tree.py")
MAX_FAILURES = 8

SYSTEM = """You are an optimization agent in SpecPilot's pilot loop. You make a lossless \
speculative-decoding plan faster. Every candidate is token-forced first: its output must equal \
greedy autoregressive decoding token for token on held-back prompts, or it is rejected \
(MISMATCH) and gets no speed figure. The harness times each request from outside the process.

Reply with exactly one of:
1. a parameter proposal for an existing mechanism, as JSON:
   ```json
   {{"mechanism": "<id>", "params": {{"<name>": <value>}}}}
   ```
2. a new mechanism: one ```python block with a module that defines classes following the \
Mechanism protocol below and `MECHANISMS = [MyMechanism()]`. Each class needs string literals \
`id` (new, "agent_" + lowercase letters, digits or _), `factor` ("tau", "kernel" or \
"overhead") and `description`, and the methods `space(ctx, plan)`, `applicable(ctx, plan)` and \
`apply(plan, params) -> Plan`; optionally `wrap_decode(decode, params) -> decode` to wrap the \
decode function (`decode(prompt_ids, gen) -> result`, `result.tokens` the output ids). You may \
add a ```json block {{"params": {{...}}}} with the values to try first.

Rules for new code (checked before it runs; it then runs in a sandbox without network or file \
access, under time and memory limits):
- imports only: {imports}
- never use: {forbidden}, dunder attributes, frame or code objects, strings containing "__";
- module level: only imports, classes, functions and assignments;
- never change outputs, never cache outputs across requests, never time anything.
Explain your idea in one or two sentences before the code."""


@dataclass
class RoundBrief:
    """The coordinator's view of one round, for the agents (all JSON-able)."""

    round: int
    direction: str
    factors: Mapping[str, float]
    report: Mapping[str, Any]
    plan: Mapping[str, Any]
    mechanisms: Sequence[Mapping[str, Any]]
    """id, factor, description and space of every mechanism that applies to the plan."""
    memory: Sequence[Mapping[str, Any]] = field(default_factory=list)


def _mechanisms_dir() -> Path:
    import specpilot.mechanisms

    return Path(specpilot.mechanisms.__file__).parent


def system_message() -> str:
    imports = "; ".join(f"from {m} import {', '.join(sorted(n))}"
                        for m, n in ALLOWED_IMPORTS.items())  # fmt: skip
    return SYSTEM.format(imports=imports, forbidden=", ".join(sorted(FORBIDDEN_NAMES)))


def round_message(brief: RoundBrief, failures: Sequence[Mapping[str, Any]]) -> str:
    d = _mechanisms_dir()
    parts = [
        f"Round {brief.round}. Your direction: the **{brief.direction}** factor.",
        "Cost-model factors (1.0 = nothing to gain; the largest is the bottleneck): "
        + json.dumps({k: round(v, 4) for k, v in brief.factors.items()}),
        "Cost-model report:\n```json\n" + json.dumps(brief.report, default=str)[:3000] + "\n```",
        "Current plan:\n```json\n" + json.dumps(brief.plan, indent=1) + "\n```",
        "The Mechanism protocol (specpilot/mechanisms/base.py):\n```python\n"
        + (d / "base.py").read_text()
        + "```",
    ]
    for name in EXAMPLES:
        parts.append(f"Example mechanism ({name}):\n```python\n{(d / name).read_text()}```")
    parts.append("Mechanisms you can tune (JSON proposals):\n" + "\n".join(
        json.dumps(m, default=str) for m in brief.mechanisms))  # fmt: skip
    if brief.memory:
        parts.append("Memory (measured effects in similar contexts, best first):\n" + "\n".join(
            json.dumps(e, default=str) for e in brief.memory))  # fmt: skip
    if failures:
        lines = [f"- {f['what']}: {f['status']}: {f['reason']}" for f in failures[-MAX_FAILURES:]]
        parts.append(
            "Your earlier proposals that failed (do not repeat them):\n" + "\n".join(lines)
        )
    parts.append("Propose one change for your direction now.")
    return "\n\n".join(parts)


def messages(
    brief: RoundBrief, failures: Sequence[Mapping[str, Any]], max_chars: int = 0
) -> list[dict[str, str]]:
    """The chat messages of one request (each cut to ``max_chars`` when positive)."""
    out = [
        {"role": "system", "content": system_message()},
        {"role": "user", "content": round_message(brief, failures)},
    ]
    if max_chars > 0:
        for m in out:
            m["content"] = m["content"][:max_chars]
    return out
