"""Draft-model drafting: a smaller model with the target's tokenizer proposes the tree.

Chain: greedy, one token per draft forward (Leviathan et al. 2023; gpt-fast ``speculative_decode``).
Dynamic tree: EAGLE-2 expansion (Li et al. 2024) - at each depth the ``topk`` nodes with the best
cumulative log-probability are expanded in ONE batched forward under a tree mask, each contributes
its ``topk`` children, and at the end the best ``budget`` nodes are kept. Static tree: the nodes
the rank paths need are expanded, one batched forward per depth.

Cache bookkeeping. The draft model's KV cache holds the committed tokens in slots
``[0, len(committed))`` at their own positions; each call re-feeds only the tokens committed since
the previous call (at least the root ``committed[-1]``, whose logits start the tree). Draft nodes
are scratch: they are written after the committed prefix, a depth-d node at position
``len(committed) - 1 + d``, and seeing the committed prefix plus its own ancestors::

    committed  t0 t1 t2 (root t2 at position 2)     slots 0..2
    depth 1    a b      (position 3)                 slots 3, 4     a sees 0..2 + 3
    depth 2    a->c     (position 4)                 slot 5         c sees 0..2 + 3 + 5

The next call overwrites the scratch slots with the newly committed tokens. The drafter owns the
draft model's cache: the model object must not also serve as the engine's target.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

from specpilot.drafters.base import DraftContext
from specpilot.errors import ContextLengthError, DrafterError
from specpilot.model import Transformer, causal_mask
from specpilot.tree import DraftTree, TreeSpec, shape_tree


def chain_paths(k: int) -> tuple[tuple[int, ...], ...]:
    """A chain of ``k`` as rank paths: (0,), (0, 0), ..."""
    return tuple((0,) * i for i in range(1, k + 1))


def path_widths(paths: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    """Rank-path prefix -> how many ranked children it needs (() is the root).

    >>> path_widths([(0,), (1,), (0, 0)])
    {(): 2, (0,): 1}
    """
    need: dict[tuple[int, ...], int] = {}
    for p in paths:
        for i, r in enumerate(p):
            need[p[:i]] = max(need.get(p[:i], 0), r + 1)
    return need


def scratch_slots(spec: TreeSpec) -> int:
    """Draft nodes a tree of ``spec`` writes to the cache (the deepest nodes are never fed)."""
    if spec.kind == "dynamic":
        return spec.topk * (spec.depth - 1)
    paths = spec.paths if spec.kind == "static" else chain_paths(spec.k)
    return len(path_widths(paths)) - 1


class _Nodes:
    """Growing draft tree: per node its token, parent, depth, score and cache slot."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.scores: list[float] = []
        self.anc_slots: list[list[int]] = []
        """Cache slots of the node's fed ancestors and itself (filled when it is fed)."""

    def add(self, tok: int, parent: int, score: float) -> int:
        self.tokens.append(tok)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        self.anc_slots.append([])
        return len(self.tokens) - 1

    def tree(self) -> DraftTree:
        return DraftTree.from_parents(self.tokens, self.parents, self.scores)


class DraftModelDrafter:
    """A small model of the target's family drafts greedily (chain) or EAGLE-2 style (trees)."""

    name = "model"
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, model: Transformer, max_len: int, *, vocab_size: int | None = None) -> None:
        """``max_len``: most cache slots (committed tokens + scratch) to allocate; the cache
        grows on demand up to it. ``vocab_size``: draft only ids below it (the target's)."""
        if not isinstance(model, Transformer):
            raise DrafterError(f"draft model must be a specpilot Transformer, got {type(model)}")
        if not isinstance(max_len, int) or max_len < 2:
            raise DrafterError(f"draft model max_len must be an integer >= 2, got {max_len!r}")
        vocab = model.cfg.vocab_size
        if vocab_size is not None and vocab_size < 1:
            raise DrafterError(f"draft vocab_size must be >= 1, got {vocab_size}")
        self.model = model
        self.max_len = max_len
        self.vocab_size = vocab if vocab_size is None else min(vocab_size, vocab)
        self._cached: list[int] = []
        """Committed tokens whose K/V sit in cache slots [0, len)."""
        self._cache_ref: weakref.ref | None = None

    # -- Drafter protocol ---------------------------------------------------------------------

    def begin(self, prompt: list[int]) -> None:
        """Nothing to reset: ``propose`` keeps the longest cached prefix the new tokens share
        (a common system prompt is not re-fed) and re-feeds the rest."""

    def finish(self, tokens: list[int]) -> None:
        """Nothing is kept across sequences."""

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        tokens, spec = ctx.tokens, ctx.spec
        n = len(tokens)
        if n == 0:
            return DraftTree.empty()
        need = n + scratch_slots(spec)
        if need > self.max_len:
            raise ContextLengthError(
                f"draft model cache of {self.max_len} slots cannot hold {n} committed tokens + "
                f"{need - n} draft slots; raise the draft model's max_len"
            )
        self._ensure_cache(need)
        root = self._feed_committed(tokens)  # (vocab,)
        if spec.kind == "dynamic":
            return self._expand_dynamic(root, n, spec)
        paths = spec.paths if spec.kind == "static" else chain_paths(spec.k)
        return self._expand_paths(root, n, paths, spec)

    # -- cache --------------------------------------------------------------------------------

    def _ensure_cache(self, need: int) -> None:
        m = self.model
        if m.max_len < need or m.batch != 1:
            m.setup_cache(min(self.max_len, max(need, 2 * m.max_len, 256)))
        cache = m.model.layers[0].self_attn.cache
        if self._cache_ref is None or self._cache_ref() is not cache:
            self._cached = []  # new or reallocated cache: nothing of ours is in it
            self._cache_ref = weakref.ref(cache)

    def _feed_committed(self, tokens: list[int]) -> Tensor:
        """Cache the committed tokens not cached yet (at least the root); the root's log-probs."""
        cached, n = self._cached, len(tokens)
        keep = min(len(cached), n)
        if tokens[:keep] != cached[:keep]:
            keep = next(i for i in range(keep) if tokens[i] != cached[i])
        keep = min(keep, n - 1)
        dev = self.model.device
        t = n - keep
        ids = torch.tensor([tokens[keep:]], dtype=torch.long, device=dev)  # (1, t)
        pos = torch.arange(keep, n, device=dev)[None]  # (1, t)
        out = self.model(
            ids, pos, keep, n, causal_mask(keep, t, n, dev), logits_rows=slice(t - 1, t)
        )
        self._cached = list(tokens)
        return self._log_probs(out.logits[0])[0]

    def _log_probs(self, logits: Tensor) -> Tensor:
        # logits: (R, vocab) -> (R, vocab_size) log-softmax over the ids the target knows
        return torch.log_softmax(logits[:, : self.vocab_size].float(), dim=-1)

    def _feed_nodes(self, nodes: _Nodes, rows: list[int], n: int, fed: int) -> Tensor:
        """One forward of draft ``rows`` at scratch slots ``n + fed, ...``; their log-probs."""
        dev = self.model.device
        t = len(rows)
        start = n + fed
        kv_len = start + t
        mask = torch.zeros(1, t, kv_len, dtype=torch.bool)  # (1, t, kv_len)
        mask[0, :, :n] = True
        for r, i in enumerate(rows):
            p = nodes.parents[i]
            anc = ([] if p < 0 else nodes.anc_slots[p]) + [start + r]
            assert p < 0 or nodes.anc_slots[p], "a node is fed before its parent"
            nodes.anc_slots[i] = anc
            mask[0, r, anc] = True
        ids = torch.tensor([[nodes.tokens[i] for i in rows]], dtype=torch.long, device=dev)
        pos = torch.tensor([[n - 1 + nodes.depths[i] for i in rows]], device=dev)  # (1, t)
        out = self.model(ids, pos, start, kv_len, mask.to(dev))
        return self._log_probs(out.logits[0])  # (t, vocab_size)

    # -- tree expansion -----------------------------------------------------------------------

    def _expand_dynamic(self, root: Tensor, n: int, spec: TreeSpec) -> DraftTree:
        """EAGLE-2: per depth, expand the ``topk`` best-scored nodes in one batched forward."""
        k = min(spec.topk, self.vocab_size)
        nodes = _Nodes()
        vals, idx = root.topk(k)
        level = [nodes.add(t, -1, v) for v, t in zip(vals.tolist(), idx.tolist(), strict=True)]
        fed = 0
        for _ in range(1, spec.depth):
            frontier = sorted(level, key=lambda i: (-nodes.scores[i], i))[:k]
            lp = self._feed_nodes(nodes, frontier, n, fed)  # (len(frontier), vocab_size)
            fed += len(frontier)
            vals, idx = lp.topk(k, dim=-1)
            level = []
            for r, i in enumerate(frontier):
                base = nodes.scores[i]
                for v, t in zip(vals[r].tolist(), idx[r].tolist(), strict=True):
                    level.append(nodes.add(t, i, base + v))
        return shape_tree(nodes.tree(), spec)

    def _expand_paths(
        self, root: Tensor, n: int, paths: Sequence[tuple[int, ...]], spec: TreeSpec
    ) -> DraftTree:
        """Chain / static tree: expand exactly the prefixes the rank paths extend."""
        need = path_widths(paths)
        nodes = _Nodes()
        prefix: list[tuple[int, ...]] = []
        level: list[int] = []
        for rank, (v, t) in enumerate(_top(root[None], need[()])[0]):
            level.append(nodes.add(t, -1, v))
            prefix.append((rank,))
        fed = 0
        for _ in range(1, spec.max_depth):
            frontier = [i for i in level if prefix[i] in need]
            if not frontier:
                break
            lp = self._feed_nodes(nodes, frontier, n, fed)
            fed += len(frontier)
            tops = _top(lp, max(need[prefix[i]] for i in frontier))
            level = []
            for r, i in enumerate(frontier):
                for rank, (v, t) in enumerate(tops[r][: need[prefix[i]]]):
                    level.append(nodes.add(t, i, nodes.scores[i] + v))
                    prefix.append((*prefix[i], rank))
        return shape_tree(nodes.tree(), spec)


def _top(lp: Tensor, k: int) -> list[list[tuple[float, int]]]:
    """Per row the ``k`` best (log-prob, token), best first; k == 1 is exactly the argmax."""
    # lp: (R, vocab)
    if k == 1:
        idx = lp.argmax(dim=-1, keepdim=True)  # (R, 1)
        vals = lp.gather(-1, idx)
    else:
        vals, idx = lp.topk(min(k, lp.shape[-1]), dim=-1)  # (R, k)
    return [list(zip(v, t, strict=True)) for v, t in zip(vals.tolist(), idx.tolist(), strict=True)]
