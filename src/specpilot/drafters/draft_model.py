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

import torch
from torch import Tensor

from specpilot.drafters.base import DraftContext
from specpilot.drafters.expand import expand_spec
from specpilot.errors import ContextLengthError, DrafterError
from specpilot.model import Transformer, causal_mask
from specpilot.tree import DraftTree, GrowingTree, TreeSpec, chain_paths, path_widths


def scratch_slots(spec: TreeSpec) -> int:
    """Draft nodes a tree of ``spec`` writes to the cache (the deepest nodes are never fed)."""
    if spec.kind == "dynamic":
        return spec.topk * (spec.depth - 1)
    paths = spec.paths if spec.kind == "static" else chain_paths(spec.k)
    return len(path_widths(paths)) - 1


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
        fed = 0  # draft nodes written to the scratch slots after the committed tokens

        def feed(nodes: GrowingTree, rows: list[int]) -> Tensor:
            nonlocal fed
            lp = self._feed_nodes(nodes, rows, n, fed)  # (len(rows), vocab_size)
            fed += len(rows)
            return lp

        return expand_spec(root, feed, spec)

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

    def _feed_nodes(self, nodes: GrowingTree, rows: list[int], n: int, fed: int) -> Tensor:
        """One forward of draft ``rows`` at scratch slots ``n + fed, ...``; their log-probs."""
        dev = self.model.device
        t = len(rows)
        start = n + fed
        kv_len = start + t
        mask = torch.zeros(1, t, kv_len, dtype=torch.bool)  # (1, t, kv_len)
        mask[0, :, :n] = True
        for r, i in enumerate(rows):
            p = nodes.parents[i]
            anc = ([] if p < 0 else nodes.states[p]) + [start + r]
            assert p < 0 or nodes.states[p], "a node is fed before its parent"
            nodes.states[i] = anc
            mask[0, r, anc] = True
        ids = torch.tensor([[nodes.tokens[i] for i in rows]], dtype=torch.long, device=dev)
        pos = torch.tensor([[n - 1 + nodes.depths[i] for i in rows]], device=dev)  # (1, t)
        out = self.model(ids, pos, start, kv_len, mask.to(dev))
        return self._log_probs(out.logits[0])  # (t, vocab_size)
