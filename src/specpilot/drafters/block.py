"""Block drafter (DFlash-style): a block of B draft tokens from one forward over mask rows.

The committed entries are those of the head (:mod:`.head`: target tapped states at ``j`` fused
with token ``j+1``), cached across steps. A step appends ``B`` mask rows (a learned mask
embedding) at positions ``root + 1 .. root + B``; each sees every committed entry and every other
mask row (non-causal within the block), and row ``i`` predicts the draft token at depth ``i``.
The per-position distributions feed a best-first tree (DDTree, Ringel et al. 2025 style): a heap
over path log-probability, where a node at depth ``i`` may be followed by any of the top-k tokens
of position ``i + 1``, until the node budget is spent.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specpilot.drafters.base import DraftContext
from specpilot.drafters.feature_net import FeatureNet
from specpilot.drafters.head import FeatureDrafter
from specpilot.tree import Continuation, DraftTree, GrowingTree, TreeSpec, build_tree


def best_first_tree(lp: Tensor, spec: TreeSpec) -> DraftTree:
    """A draft tree from per-position log-probs ``lp`` (D, V): position i scores depth i+1.

    Chain: the argmax of each position. Dynamic: best-first over the path score (sum of the
    chosen tokens' log-probs) under ``spec.budget`` nodes, ``spec.topk`` candidates per position.
    Static: the rank paths of ``spec`` (rank r at depth d = the r-th best token of position d).

    >>> lp = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05]]))
    >>> t = best_first_tree(lp, TreeSpec(kind="dynamic", budget=3, topk=2, depth=2))
    >>> t.tokens.tolist(), t.parents.tolist()     # 0 (.6), 0->0 (.54), 1 (.3)
    ([0, 0, 1], [-1, 0, -1])
    """
    depth = min(lp.shape[0], spec.max_depth)
    if depth == 0:
        return DraftTree.empty()
    k = min(spec.branching, lp.shape[1])
    vals, idx = lp[:depth].float().topk(k, dim=-1)  # (D, k)
    vals_l, idx_l = vals.tolist(), idx.tolist()

    def children(nodes: GrowingTree, frontier: list[int], width: int) -> list[list[Continuation]]:
        # a node at depth d continues with the best tokens of position d (the root: position 0)
        out = []
        for i in frontier:
            d = 0 if i < 0 else nodes.depths[i]
            out.append([(vals_l[d][r], idx_l[d][r], None) for r in range(min(width, k))])
        return out

    return build_tree(children, spec, max_depth=depth, width=k)


class BlockDrafter(FeatureDrafter):
    """DFlash-style: ``cfg.block`` tokens' distributions per forward; trees built best-first."""

    name = "block"

    @torch.no_grad()
    def block_log_probs(self, ctx: DraftContext) -> Tensor:
        """(B, draft_vocab) log-probs of the next ``B`` positions after the root."""
        b = self.cfg.block
        last = self._feed_committed(ctx, b)
        m = self._m
        dev = last.device
        x = self.net.mask_emb.expand(1, b, -1)  # (1, B, dim)
        pos = torch.arange(m, m + b, device=dev)[None]
        mask = torch.ones(1, b, m + b, dtype=torch.bool)
        out = self._run(x, pos, m, m + b, mask)[0]  # (B, dim)
        self.forwards += 1
        return self._log_probs(out)

    def propose(self, ctx: DraftContext) -> DraftTree:
        lp = self.block_log_probs(ctx)
        return self._map(best_first_tree(lp, ctx.spec))


def block_train_logits(
    net: FeatureNet, taps: Tensor, tokens: Tensor, anchors: int = 32, seed: int = 0
) -> list[tuple[Tensor, Tensor]]:
    """Training forward: blocks after ``anchors`` evenly spread anchors of each sequence.

    taps (B, T, n_taps, dim), tokens (B, T). Returns per block row ``i`` (depth i+1) the logits
    (B, A, V) and the target positions (A,) whose next-token distribution they should match
    (anchor + i + 1; the caller masks positions past the sequence).
    """
    bsz, t = tokens.shape
    n = t - 1
    blk = net.cfg.block
    dev = tokens.device
    a = min(anchors, n)
    g = torch.Generator().manual_seed(seed + t)
    off = int(torch.randint(0, max(n // a, 1), (1,), generator=g))
    anc = (torch.linspace(0, n - 1, a).long() + off).clamp(max=n - 1).to(dev)  # (A,)
    x_e = net.entries(taps[:, :n], tokens[:, 1:])  # (B, n, dim)
    pos_e = torch.arange(n, device=dev)[None].expand(bsz, n)
    causal = (torch.arange(n, device=dev)[None, :] <= torch.arange(n, device=dev)[:, None])[None]
    row_anchor = anc.repeat_interleave(blk)  # (A*blk,)
    depth = torch.arange(1, blk + 1, device=dev).repeat(a)  # (A*blk,)
    x_b = net.mask_emb.expand(bsz, a * blk, -1)
    pos_b = (row_anchor + depth)[None].expand(bsz, -1)
    mask_b = block_mask(anc, n, blk)[None]
    for layer in net.layers:
        q_e, k_e, v_e = layer.kv(x_e, pos_e)
        q_b, k_b, v_b = layer.kv(x_b, pos_b)
        x_b = layer.finish(x_b, q_b, torch.cat([k_e, k_b], 2), torch.cat([v_e, v_b], 2), mask_b)
        x_e = layer.finish(x_e, q_e, k_e, v_e, causal)
    logits = net.logits(x_b).view(bsz, a, blk, -1)
    return [(logits[:, :, i], anc + i + 1) for i in range(blk)]


def block_mask(anchors: Tensor, n: int, blk: int) -> Tensor:
    """(A*blk, n + A*blk) bool: block rows (anchor-major) over [entries ; block rows].

    A row of the block after anchor j sees entries 0..j and every row of its own block
    (non-causal within the block), nothing of other blocks.

    >>> block_mask(torch.tensor([0, 1]), 2, 2).int().tolist()
    [[1, 0, 1, 1, 0, 0], [1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1]]
    """
    row_anchor = anchors.repeat_interleave(blk)  # (A*blk,)
    see_e = torch.arange(n, device=anchors.device)[None, :] <= row_anchor[:, None]
    rows = torch.arange(row_anchor.shape[0], device=anchors.device) // blk
    see_b = rows[:, None] == rows[None, :]
    return torch.cat([see_e, see_b], dim=1)
