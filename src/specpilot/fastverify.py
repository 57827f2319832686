"""Overhead mechanisms of the verify step: preallocated buffers, on-device acceptance, CUDA graphs.

The engine's default step (:func:`specpilot.verify.verify_step`) allocates a fresh mask each step,
reads the target's choices back to the host, walks the tree in Python, and sends the compaction
indices back to the device. :class:`FastVerifier` replaces it, switch by switch (all greedy only;
the engine keeps its own step for sampling):

* ``static_buffers`` - tokens, positions and the attention mask live in buffers allocated once per
  cache and reused every step (SGLang passes preallocated mask/position buffers the same way). The
  mask buffer stays all True between steps; a step writes its tree block and restores it after.
* ``device_accept`` - greedy acceptance as tensor ops on the device (a node is accepted when it and
  every ancestor match the target's choice at their parent; the deepest accepted node ends the
  path), then ONE device-to-host read of (path, bonus); compaction and hidden-state rows use
  device indices (no host-to-device copy of indices).
* ``cuda_graphs`` - the verify forward at static shapes, captured once per (width bucket, key
  bucket) and replayed (vLLM/SGLang capture decode the same way). The tree is padded to the next
  power-of-two width with dummy rows that see only the root and write to slots past the tree; the
  keys are padded to a multiple of 256 with masked-out slots. Implies the two switches above.
  ``capture=False`` runs the same padded path eagerly (how CPU tests check it).
* ``fixed_width`` - lossless by construction with kernels that are not batch-invariant: every
  step, plain or verifying, is one forward of exactly ``fixed_width`` rows over every slot of the
  cache (keys past a row's prefix masked), so every call has the same shapes and a row's result
  depends on its own inputs alone (a kernel applies one reduction order to every row of a call of
  one shape; stock GPU GEMMs, norms and attention change order with the row count and key
  length: ``bench/gpu_check.py`` measures it). Chains only: a chain's node at depth d sits at
  slot ``cache_len + d``, its position, so it sees the keys of plain decoding in the same slots;
  a tree's siblings cannot all sit at their positions. Graph-captured on CUDA with
  ``cuda_graphs`` (one shape, one graph per tapped-layer set), eager otherwise.

Greedy acceptance on the device picks the deepest fully matching node. With distinct sibling
tokens that is the path :func:`specpilot.tree.verify_greedy` follows; with two identical siblings
it may take the other (deeper) one, but every fully matching path spells the target's own greedy
continuation, so the output is the same (the step may commit more of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specpilot.model import Transformer
from specpilot.tree import DraftTree, tree_mask
from specpilot.verify import (
    StepOutcome,
    VerifyRow,
    accept,
    build_inputs,
    check_fixed,
    commit,
    committed_rows,
    forward,
)

KV_BUCKET = 256
"""Key-length granularity of captured graphs (cache slots)."""


def width_bucket(rows: int) -> int:
    """Smallest power of two >= ``rows`` (the padded verify width of a graph)."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class _Buffers:
    tokens: Tensor
    """(1, W) long."""
    positions: Tensor
    """(1, W) long."""
    slots: Tensor
    """(W,) long: cache slot of each verify row (graphs write K/V at tensor slots)."""
    mask: Tensor
    """(1, W, max_len) bool; all True between steps."""
    cache: Any
    """The KV cache tensor these buffers were sized for (reallocation -> new buffers)."""


def accept_on_device(
    target: Tensor, tokens: Tensor, parents: Tensor, depths: Tensor, anc: Tensor
) -> tuple[Tensor, Tensor]:
    """Greedy acceptance without leaving the device.

    target: (R,) long, the target's argmax per verify row (row 0 = root, row i+1 = node i)
    tokens, parents, depths: (n,) long (parents -1 = root); anc: (n, n) bool, anc[i, j] = node j
    is node i or one of its ancestors. Returns (path mask (n,) bool, bonus token () long).

    >>> t = DraftTree.from_parents([5, 6, 7], [-1, -1, 0])
    >>> m = tree_mask(t)[1:, 1:]
    >>> path, bonus = accept_on_device(torch.tensor([5, 7, 9, 8]), t.tokens, t.parents,
    ...                                t.depths, m)
    >>> path.tolist(), int(bonus)
    ([True, False, True], 8)
    """
    n = tokens.shape[0]
    match = tokens == target[parents + 1]  # (n,)
    ok = ~(anc & ~match[None, :]).any(-1)  # (n,) node and all its ancestors match
    idx = torch.arange(n, device=tokens.device)
    key = torch.where(ok, depths * (n + 1) + (n - idx), torch.zeros_like(idx))
    best = key.argmax()
    has = ok[best]
    path = anc[best] & has  # (n,)
    bonus = target[torch.where(has, best + 1, torch.zeros_like(best))]
    return path, bonus


class FastVerifier:
    """The engine's verify step with the switches of the module docstring turned on."""

    def __init__(
        self,
        model: Transformer,
        *,
        static_buffers: bool = False,
        device_accept: bool = False,
        cuda_graphs: bool = False,
        capture: bool | None = None,
        fixed_width: int = 0,
    ) -> None:
        self.model = model
        self.fixed = fixed_width
        self.padded = cuda_graphs or fixed_width > 0
        self.capture = (model.device.type == "cuda") if capture is None else capture
        self.capture = self.capture and cuda_graphs
        self.buffers = static_buffers or self.padded
        self.device_accept = device_accept or cuda_graphs
        self._bufs: _Buffers | None = None
        self._graphs: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any]] = {}
        self._pool: Any = None
        self.replays = 0
        """Steps served by a captured graph (tests and reports read it)."""

    # -- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(
        self, root: int, cache_len: int, tree: DraftTree, taps: tuple[int, ...]
    ) -> StepOutcome:
        """Same contract as :func:`specpilot.verify.verify_step` for one greedy sequence."""
        n = tree.size
        m = self.model
        tm = tree_mask(tree)  # (n+1, n+1)
        width, kv, graph = n + 1, cache_len + n + 1, False
        if self.fixed:
            check_fixed(tree, self.fixed, cache_len, m.max_len)
            width, kv, graph = self.fixed, m.max_len, self.capture
        elif self.padded:
            w = width_bucket(n + 1)
            kvp = min(m.max_len, -(-(cache_len + w) // KV_BUCKET) * KV_BUCKET)
            if cache_len + w <= kvp:  # else near the end of the cache: unpadded this step
                width, kv, graph = w, kvp, self.capture
        if self.buffers:
            out, mask_region = self._forward_buffered(
                root, cache_len, tree, tm, width, kv, taps, graph
            )
        else:
            rows = [VerifyRow(root, cache_len, tree)]
            inputs = build_inputs(rows, m.device, m.max_len - 1)
            out, mask_region = forward(m, inputs, taps), None
        logits = out.logits[0]  # (width, V)
        try:
            path, new, keep = self._accept(logits, cache_len, tree, tm)
        finally:
            if mask_region is not None:
                mask_region.fill_(True)
        hidden = tuple(h[0, keep] for h in out.hidden)
        return StepOutcome(path, new, logits[: n + 1], hidden)

    def _forward_buffered(
        self,
        root: int,
        cache_len: int,
        tree: DraftTree,
        tm: Tensor,
        width: int,
        kv: int,
        taps: tuple[int, ...],
        graph: bool,
    ) -> tuple[Any, Tensor]:
        n = tree.size
        b = self._buffers(width)
        host_tok = torch.zeros(width, dtype=torch.long)
        host_tok[0] = root
        host_tok[1 : n + 1] = tree.tokens
        host_pos = torch.full((width,), cache_len, dtype=torch.long)
        host_pos[1 : n + 1] += tree.depths
        b.tokens[0, :width].copy_(host_tok, non_blocking=True)
        b.positions[0, :width].copy_(host_pos, non_blocking=True)
        region = b.mask[0, :width, cache_len:kv]  # (width, kv - cache_len)
        if width > n + 1 or kv > cache_len + n + 1:
            region.fill_(False)
            region[n + 1 :, 0] = True  # dummy rows see the root only
        region[: n + 1, : n + 1].copy_(tm, non_blocking=True)
        toks, pos = b.tokens[:, :width], b.positions[:, :width]
        mask = b.mask[:, :width, :kv]
        if not self.padded:
            return self.model(toks, pos, cache_len, kv, mask, hidden_layers=taps), region
        slots = b.slots[:width]
        slots.copy_(torch.arange(cache_len, cache_len + width), non_blocking=True)
        if not graph:
            return self.model(toks, pos, slots, kv, mask, hidden_layers=taps), region
        key = (width, kv, taps)
        if key not in self._graphs:
            self._graphs[key] = self._capture_graph(toks, pos, slots, kv, mask, taps)
        captured, static_out = self._graphs[key]
        captured.replay()
        self.replays += 1
        return static_out, region

    def _buffers(self, width: int) -> _Buffers:
        m = self.model
        cache = m.model.layers[0].self_attn.cache
        assert cache is not None, "call Transformer.setup_cache() first"
        b = self._bufs
        if b is None or b.cache is not cache.k or b.tokens.shape[1] < width:
            dev = m.device
            cap = max(width_bucket(width), 16 if b is None else b.tokens.shape[1])
            self._bufs = b = _Buffers(
                tokens=torch.zeros(1, cap, dtype=torch.long, device=dev),
                positions=torch.zeros(1, cap, dtype=torch.long, device=dev),
                slots=torch.zeros(cap, dtype=torch.long, device=dev),
                mask=torch.ones(1, cap, m.max_len, dtype=torch.bool, device=dev),
                cache=cache.k,
            )
            self._graphs.clear()  # captured against the old buffers
        return b

    def _capture_graph(
        self, toks: Tensor, pos: Tensor, slots: Tensor, kv: int, mask: Tensor, taps: tuple
    ) -> tuple[Any, Any]:
        """Capture the verify forward at these buffers (warm-up on a side stream first)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # rewrites the same K/V the replay will write
                self.model(toks, pos, slots, kv, mask, hidden_layers=taps)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.model(toks, pos, slots, kv, mask, hidden_layers=taps)
        self._pool = graph.pool()
        return graph, out

    # -- accept + commit ----------------------------------------------------------------------

    def _accept(
        self, logits: Tensor, cache_len: int, tree: DraftTree, tm: Tensor
    ) -> tuple[tuple[int, ...], list[int], Any]:
        """(path, new tokens, hidden rows to keep); compacts the cache onto the accepted path."""
        m = self.model
        dev = m.device
        n = tree.size
        if not self.device_accept:
            acc = accept(tree, logits[: n + 1])
            commit(m, cache_len, acc.path)
            return acc.path, list(acc.tokens), committed_rows(acc.path)
        target = logits[: n + 1].argmax(-1)  # (n+1,)
        if n == 0:
            return (), [int(target[0])], [0]
        d_tok = tree.tokens.to(dev, non_blocking=True)
        d_par = tree.parents.to(dev, non_blocking=True)
        d_dep = tree.depths.to(dev, non_blocking=True)
        anc = tm[1:, 1:].to(dev, non_blocking=True)  # (n, n)
        path_mask, bonus = accept_on_device(target, d_tok, d_par, d_dep, anc)
        info = torch.cat([path_mask.long(), bonus.view(1)]).tolist()  # the one host read
        path = tuple(i for i in range(n) if info[i])
        toks = tree.tokens.tolist()
        new = [toks[i] for i in path] + [int(info[n])]
        node_idx = path_mask.nonzero().squeeze(1)  # (len(path),) ascending = root to leaf
        if path and path != tuple(range(len(path))):
            m.compact_cache(cache_len + 1 + node_idx, cache_len + 1)
        rows = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), node_idx + 1])
        return path, new, rows
