"""Hybrid drafting: a cheap drafter first, another one when it proposes too little.

Training-free drafters (prompt lookup, suffix trees) cost microseconds but propose nothing when
the text does not repeat; a draft model (or another training-free drafter) covers those steps.
This wrapper asks ``primary`` first and falls back to ``fallback`` when the primary's tree has
fewer than ``min_nodes`` nodes (the tree with more nodes wins). Both see every sequence
(``begin``/``finish``), so suffix corpora and draft-model caches stay in step; a draft model
re-feeds the tokens committed since its last call itself.

Fallbacks that read the target's hidden states (trained feature drafters) are not supported:
they must see the hidden states of every committed token, and a fallback is not called every
step.

    >>> from specpilot.drafters import make_drafter
    >>> from specpilot.drafters.base import DraftContext
    >>> from specpilot.tree import TreeSpec
    >>> h = HybridDrafter(make_drafter("lookup"), make_drafter("suffix"))
    >>> h.begin([1, 2, 3]); h.name
    'lookup+suffix'
"""

from __future__ import annotations

from specpilot.drafters.base import DraftContext, Drafter
from specpilot.errors import DrafterError
from specpilot.tree import DraftTree


class HybridDrafter:
    """``primary`` first; ``fallback`` when the primary proposes fewer than ``min_nodes``."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, primary: Drafter, fallback: Drafter, min_nodes: int = 1) -> None:
        if primary.hidden_layers or fallback.hidden_layers:
            raise DrafterError(
                "hybrid drafting takes drafters that do not read target hidden states "
                "(lookup, suffix, model); use a trained drafter on its own"
            )
        if min_nodes < 1:
            raise DrafterError(f"hybrid min_nodes must be >= 1, got {min_nodes}")
        self.primary, self.fallback, self.min_nodes = primary, fallback, min_nodes
        self.name = f"{primary.name}+{fallback.name}"
        self.fallback_steps = 0
        """Steps whose tree came from the fallback (reports read it)."""

    def begin(self, prompt: list[int]) -> None:
        self.primary.begin(prompt)
        self.fallback.begin(prompt)

    def propose(self, ctx: DraftContext) -> DraftTree:
        tree = self.primary.propose(ctx)
        if tree.size >= self.min_nodes:
            return tree
        other = self.fallback.propose(ctx)
        if other.size > tree.size:
            self.fallback_steps += 1
            return other
        return tree

    def finish(self, tokens: list[int]) -> None:
        self.primary.finish(tokens)
        self.fallback.finish(tokens)
