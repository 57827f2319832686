"""How alike two contexts are, field by field: what memory ranks remembered effects by.

:func:`similarity_reasons` is the whole judgement as data: for every field of a
:class:`~specpilot.mechanisms.base.Context` that transfer depends on (architecture, drafter,
device and the host's ISA and CPU model, dtype, batch size, model size, vocabulary size, weights
mode) its two values, its weight, its score in ``[0, weight]`` and a word for why. Equal values
(both unknown included) score the full weight; a value unknown on one side (an entry recorded
before contexts carried that field) half of it; numbers score by closeness on a log scale; other
differences score 0. :func:`similarity` is the sum (1 for the same context). ``specpilot memory
show`` renders the reasons.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from specpilot.mechanisms.base import Context

WEIGHTS: dict[str, float] = {
    "arch": 0.3,
    "drafter_kind": 0.2,
    "device": 0.15,
    "isa": 0.08,
    "cpu_model": 0.02,
    "dtype": 0.05,
    "batch_size": 0.08,
    "params_m": 0.04,
    "vocab_size": 0.04,
    "weights": 0.04,
}
"""Weight of each field (they sum to 1)."""
_LOG_SCALE = {"batch_size": 2.0, "params_m": 10.0, "vocab_size": 10.0}
"""Numeric fields scored by closeness ``1 / (1 + |log_base(a / b)|)``."""
_UNKNOWN: tuple[Any, ...] = ("", 0, None)


@dataclass(frozen=True)
class Reason:
    """One field's part in a similarity."""

    field: str
    ours: Any
    """The value in the context compared against (the current one)."""
    theirs: Any
    """The value in the remembered entry's context."""
    weight: float
    score: float
    """In ``[0, weight]``."""
    how: str
    """"equal", "differs", "unknown" (one side does not know it) or "closeness 0.58"."""


def _score(name: str, a: Any, b: Any, weight: float) -> tuple[float, str]:
    if a == b:
        return weight, "equal"
    if a in _UNKNOWN or b in _UNKNOWN:
        return weight / 2, "unknown"
    base = _LOG_SCALE.get(name)
    if base is None:
        return 0.0, "differs"
    ratio = max(float(a), 1e-3) / max(float(b), 1e-3)
    close = 1.0 / (1.0 + abs(math.log(ratio, base)))
    return weight * close, f"closeness {close:.2f}"


def similarity_reasons(ours: Context, theirs: Context) -> tuple[Reason, ...]:
    """Every weighted field of the two contexts, in :data:`WEIGHTS` order.

    >>> a = Context("llama", 135.0, "suffix", "cpu", "float32", isa="avx2", vocab_size=49152)
    >>> b = Context("gemma3", 268.0, "suffix", "cpu", "float32", isa="avx2")
    >>> [(r.field, r.how) for r in similarity_reasons(a, b) if r.how != "equal"]
    [('arch', 'differs'), ('params_m', 'closeness 0.77'), ('vocab_size', 'unknown')]
    """
    out = []
    for name, weight in WEIGHTS.items():
        a, b = getattr(ours, name), getattr(theirs, name)
        score, how = _score(name, a, b, weight)
        out.append(Reason(name, a, b, weight, round(score, 6), how))
    return tuple(out)


def similarity(a: Context, b: Context) -> float:
    """In [0, 1]: the sum of :func:`similarity_reasons`' scores (1 for the same context)."""
    return round(sum(r.score for r in similarity_reasons(a, b)), 6)
