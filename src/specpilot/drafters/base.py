"""The ``Drafter`` protocol: what the engine asks of every drafter.

A drafter proposes a :class:`~specpilot.tree.DraftTree` of candidate continuations of the
committed tokens; the engine verifies it with one target forward. Drafters are stateful per
sequence (``begin`` resets them) and may keep state across sequences (``finish`` feeds a finished
output to drafters that learn from earlier outputs, like the suffix drafter).

Trained feature-level and block drafters need the target's hidden states: they list the layers
they tap in ``hidden_layers`` and the engine passes those states of newly committed tokens in
:class:`DraftContext.hidden`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from torch import Tensor

from specpilot.tree import DraftTree, TreeSpec


@dataclass
class DraftContext:
    """Everything a drafter may read when proposing."""

    tokens: list[int]
    """All committed tokens, prompt first; the root of the next tree is ``tokens[-1]``."""
    prompt_len: int
    spec: TreeSpec
    """Requested shape; the returned tree must have at most ``spec.max_nodes`` nodes and depth
    at most ``spec.max_depth``."""
    hidden: tuple[Tensor, ...] = field(default_factory=tuple)
    """For drafters with ``hidden_layers``: per tapped layer, (n_new, dim) target hidden states of
    the tokens committed since the previous call (aligned with ``tokens[-n_new-1:-1]``)."""


@runtime_checkable
class Drafter(Protocol):
    name: str
    """Short identifier shown in reports (e.g. "lookup", "suffix", "model")."""
    hidden_layers: tuple[int, ...]
    """Target layers whose hidden states the drafter needs; () for training-free drafters."""

    def begin(self, prompt: list[int]) -> None:
        """Start a new sequence with this prompt."""

    def propose(self, ctx: DraftContext) -> DraftTree:
        """Return a draft tree continuing ``ctx.tokens`` (may be empty)."""

    def finish(self, tokens: list[int]) -> None:
        """The sequence ended with these committed tokens (prompt + output)."""


@runtime_checkable
class Tiered(Protocol):
    """A drafter with a cheap part that can draft alone while its dear part sits out (the
    union's copy drafter beside its trained head): the goodput budget runs the cheap part every
    step and the dear part only where it pays over the cheap part alone
    (:class:`specpilot.goodput.Selector`). The dear part catches up on the target states of
    the steps it sat out when it next drafts, so its drafts are the same as if it never had."""

    last_cheap: DraftTree
    """The cheap part's own tree of the last :meth:`propose` (what the step would have verified
    had only the cheap part drafted)."""

    def propose_cheap(self, ctx: DraftContext) -> DraftTree:
        """The cheap part's tree alone (``ctx.hidden`` is kept for the dear part)."""


_TIERED: dict[type, bool] = {}


def is_tiered(drafter: object) -> bool:
    """``isinstance(drafter, Tiered)``, cached per class: a runtime-checkable protocol's check
    walks its members on every call (~30 us), and the engines ask per step and sequence."""
    t = type(drafter)
    got = _TIERED.get(t)
    if got is None:
        got = _TIERED[t] = isinstance(drafter, Tiered)
    return got


def propose_all(drafters: Sequence[Drafter], ctxs: Sequence[DraftContext]) -> list[DraftTree]:
    """Each drafter's :meth:`~Drafter.propose` for its context, in order. Drafters that can
    draft together (a ``batch_key()`` and a static ``propose_batch(drafters, ctxs)``, e.g. trained
    heads over one net, whose weights are then read once per depth for all sequences) are asked
    in one call per class and key; every other drafter, and one alone in its group, by its own
    ``propose``."""
    out: list[DraftTree | None] = [None] * len(drafters)
    groups: dict[tuple[type, object], list[int]] = {}
    for i, d in enumerate(drafters):
        key = getattr(d, "batch_key", None)
        if key is None:
            out[i] = d.propose(ctxs[i])
        else:
            groups.setdefault((type(d), key()), []).append(i)
    for (cls, _), idx in groups.items():
        if len(idx) == 1:
            out[idx[0]] = drafters[idx[0]].propose(ctxs[idx[0]])
            continue
        trees = cls.propose_batch([drafters[i] for i in idx], [ctxs[i] for i in idx])  # type: ignore[attr-defined]
        for i, t in zip(idx, trees, strict=True):
            out[i] = t
    return out  # type: ignore[return-value]
