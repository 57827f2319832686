"""Prompt lookup drafting: copy what followed an earlier occurrence of the last n tokens.

Training-free n-gram drafting (Saxena 2023, "prompt lookup decoding"; vLLM ``ngram_proposer``,
HF ``prompt_lookup_num_tokens``). The last n committed tokens, longest n first (``max_n`` down to
``min_n``), are looked up among earlier n-grams of prompt + output; the tokens that followed the
most recent earlier occurrence are the draft. A continuation may run into the current suffix, and
is then copied from itself (as in LZ77), so a repeating pattern drafts its next repeats::

    tokens = [7, 1, 2, 3, 1, 2]      # the 2-gram (1, 2) ended at index 2 before
    continuation(tokens, end=3, 5)   # -> [3, 1, 2, 3, 1]

Chain specs get the best match's continuation. Tree specs merge the continuations of several
matches into a candidate trie (a node's score is the log of the share of match weight supporting
its prefix, discounted per depth) cut to the spec with :func:`~specpilot.tree.shape_tree`.

An index from n-gram to its end positions is updated as tokens are committed, so ``propose``
costs a few dictionary lookups, not a scan of the context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specpilot.drafters.base import DraftContext
from specpilot.errors import DrafterError
from specpilot.tree import DraftTree, shape_tree


def continuation(tokens: Sequence[int], end: int, n: int) -> list[int]:
    """Up to ``n`` tokens following ``tokens[:end]``, copying from the draft itself past the end.

    >>> continuation([7, 1, 2, 3, 1, 2], 3, 5)
    [3, 1, 2, 3, 1]
    """
    size = len(tokens)
    assert 0 < end <= size, (end, size)
    out: list[int] = []
    for i in range(n):
        j = end + i
        if j < size:
            out.append(tokens[j])
        elif j - size < len(out):
            out.append(out[j - size])
        else:  # end == size: nothing follows the match
            break
    return out


def merge_continuations(
    conts: Sequence[tuple[Sequence[int], float]], discount: float, budget: int | None = None
) -> DraftTree:
    """Candidate trie of weighted continuations; score = log(weight share) + depth * log(discount).

    With ``budget``, only the best ``budget`` nodes are kept (ancestor-closed: a child's score
    is never above its parent's, and ties go to the shallower node).

    >>> t = merge_continuations([([5, 6], 1.0), ([5, 7], 1.0)], discount=1.0)
    >>> t.tokens.tolist(), t.parents.tolist(), [round(s, 3) for s in t.scores.tolist()]
    ([5, 6, 7], [-1, 0, 0], [0.0, -0.693, -0.693])
    """
    total = sum(w for _, w in conts)
    if total <= 0:
        return DraftTree.empty()
    index: dict[tuple[int, int], int] = {}
    toks: list[int] = []
    parents: list[int] = []
    weight: list[float] = []
    for cont, w in conts:
        node = -1
        for tok in cont:
            child = index.get((node, tok))
            if child is None:
                child = len(toks)
                index[(node, tok)] = child
                toks.append(tok)
                parents.append(node)
                weight.append(0.0)
            weight[child] += w
            node = child
    log_d = math.log(discount)
    depths: list[int] = []
    scores: list[float] = []
    for i, p in enumerate(parents):
        depths.append(1 if p < 0 else depths[p] + 1)
        scores.append(math.log(weight[i] / total) + depths[i] * log_d)
    if budget is not None and len(toks) > budget:
        order = sorted(range(len(toks)), key=lambda i: (-scores[i], depths[i], i))
        keep = sorted(order[:budget])
        new = {old: j for j, old in enumerate(keep)}
        toks = [toks[i] for i in keep]
        parents = [new[parents[i]] if parents[i] >= 0 else -1 for i in keep]
        scores = [scores[i] for i in keep]
    return DraftTree.from_parents(toks, parents, scores)


class PromptLookupDrafter:
    """n-gram lookup over prompt + output (see the module docstring)."""

    name = "lookup"
    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, min_n: int = 1, max_n: int = 4, max_matches: int = 8, discount: float = 0.9
    ) -> None:
        """``max_matches`` earlier occurrences feed a tree; ``discount`` (0, 1] per depth."""
        if not 1 <= min_n <= max_n:
            raise DrafterError(
                f"lookup drafter needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}"
            )
        if max_matches < 1:
            raise DrafterError(f"lookup drafter max_matches must be >= 1, got {max_matches}")
        if not 0.0 < discount <= 1.0:
            raise DrafterError(f"lookup drafter discount must be in (0, 1], got {discount}")
        self.min_n, self.max_n = min_n, max_n
        self.max_matches = max_matches
        self.discount = discount
        self._tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        """n-gram -> ascending end positions e (the n-gram is tokens[e - n:e])."""

    # -- Drafter protocol ---------------------------------------------------------------------

    def begin(self, prompt: list[int]) -> None:
        self._tokens = []
        self._ends = {}
        self._extend(prompt)

    def propose(self, ctx: DraftContext) -> DraftTree:
        self._sync(ctx.tokens)
        spec = ctx.spec
        matches = self.matches(1 if spec.kind == "chain" else self.max_matches)
        if not matches:
            return DraftTree.empty()
        depth = spec.max_depth
        if spec.kind == "chain":
            cont = continuation(self._tokens, matches[0][0], depth)
            log_d = math.log(self.discount)
            return DraftTree.chain(cont, [(i + 1) * log_d for i in range(len(cont))])
        conts = [(continuation(self._tokens, e, depth), float(n)) for e, n in matches]
        budget = spec.budget if spec.kind == "dynamic" else None
        return shape_tree(merge_continuations(conts, self.discount, budget), spec)

    def finish(self, tokens: list[int]) -> None:
        """Nothing is kept across sequences."""

    # -- matching -----------------------------------------------------------------------------

    def matches(self, limit: int) -> list[tuple[int, int]]:
        """Up to ``limit`` earlier occurrences of the current suffix as (end, n): longest n
        first, most recent first, each end position once (with its longest n)."""
        toks = self._tokens
        size = len(toks)
        out: list[tuple[int, int]] = []
        seen: set[int] = set()
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            ends = self._ends.get(tuple(toks[size - n :]), ())
            # the last entry is the suffix itself (end == size): nothing follows it yet
            for i in range(len(ends) - 2, -1, -1):
                e = ends[i]
                if e not in seen:
                    seen.add(e)
                    out.append((e, n))
                    if len(out) >= limit:
                        return out
        return out

    def _sync(self, tokens: list[int]) -> None:
        """Index the tokens committed since the last call (re-index if the history changed)."""
        known = len(self._tokens)
        if len(tokens) < known or tokens[:known] != self._tokens:
            self.begin([])
            known = 0
        self._extend(tokens[known:])

    def _extend(self, new: Sequence[int]) -> None:
        toks, ends = self._tokens, self._ends
        lo, hi = self.min_n, self.max_n
        for tok in new:
            toks.append(tok)
            size = len(toks)
            for n in range(lo, min(hi, size) + 1):
                key = tuple(toks[size - n :])
                lst = ends.get(key)
                if lst is None:
                    ends[key] = [size]
                else:
                    lst.append(size)
