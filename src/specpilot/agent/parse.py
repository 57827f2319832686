"""Turning an agent's reply into a proposal (pure functions; nothing is executed).

A reply holds either

* a parameter proposal for an existing mechanism, as JSON (fenced or bare)::

      {"mechanism": "chain_length", "params": {"k": 6}}

* or a new mechanism: one fenced ``python`` block with a module exposing ``MECHANISMS = [...]``,
  optionally followed by a JSON block ``{"params": {...}}`` for its first trial (its declared
  defaults otherwise).

Anything else raises :class:`ParseError` with a reason the agent is shown next time.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

PARAMS, SOURCE = "params", "source"
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


class ParseError(ValueError):
    """The reply holds no usable proposal; the message says why."""


@dataclass(frozen=True)
class Proposal:
    kind: str
    """:data:`PARAMS` (an existing mechanism) or :data:`SOURCE` (a new one)."""
    mechanism: str = ""
    """The mechanism id (PARAMS; for SOURCE it comes from the checked source)."""
    params: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    note: str = ""
    """The agent's text outside the code (its rationale), shortened."""


def parse_reply(text: str) -> Proposal:
    if not text or not text.strip():
        raise ParseError("empty reply")
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    note = _FENCE.sub("", text).strip()[:500]
    code = [b for lang, b in blocks if lang in ("python", "py", "python3")]
    if not code:  # an unlabelled block that looks like a mechanism module
        code = [b for lang, b in blocks if lang == "" and "MECHANISMS" in b]
    objs = [o for o in (_json(b) for lang, b in blocks if lang in ("json", "")) if o is not None]
    if code:
        if len(code) > 1:
            raise ParseError("the reply has several python blocks; send one module")
        params: dict[str, Any] = {}
        for o in objs:
            if isinstance(o.get("params"), dict):
                params = o["params"]
        return Proposal(SOURCE, params=params, source=code[0], note=note)
    if not objs:
        bare = _json(text.strip())
        objs = [bare] if bare is not None else []
    for o in objs:
        mech, params = o.get("mechanism"), o.get("params", {})
        if isinstance(mech, str) and mech and isinstance(params, dict):
            return Proposal(PARAMS, mechanism=mech, params=params, note=note)
    if objs:
        raise ParseError('the JSON proposal needs {"mechanism": "<id>", "params": {...}}')
    raise ParseError(
        "no proposal found: reply with one ```python block holding a mechanism module "
        '(MECHANISMS = [...]) or a JSON object {"mechanism": ..., "params": {...}}'
    )


def _json(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
