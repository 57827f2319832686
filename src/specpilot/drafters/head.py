"""Feature-level head drafter (EAGLE-style) and the cache both trained drafters keep.

The head (EAGLE, Li et al. 2024; EAGLE-3, Li et al. 2025) is :class:`FeatureNet` with one decoder
layer. Entry ``j`` fuses the target's tapped hidden states at ``j`` with the embedding of token
``j+1`` and predicts token ``j+2`` through the target's (optionally reduced, FR-Spec) LM head.
A draft node at depth ``d`` feeds its parent's output state (in place of target features) with its
own token, at position ``root + d - 1`` -- exactly what training unrolls (:func:`head_unroll`,
EAGLE-3's training-time test), so depth-2..6 acceptance is trained too.

Cache. The drafter keeps its layers' K/V of the committed entries across steps: each ``propose``
feeds only the entries of tokens committed since the previous call (their target hidden states
arrive in :attr:`DraftContext.hidden`), then draft nodes go to scratch slots after them, seeing
the committed entries plus their own ancestors (as :mod:`specpilot.drafters.draft_model`).
Trees: chains and static trees follow rank paths; dynamic trees expand the ``topk`` best nodes per
depth in one batched forward (EAGLE-2) and keep the best ``budget`` (:mod:`.expand`).

Native targets: the drafter reads the target's GGUF embedding and LM-head blocks in place, never an
fp32 copy (:meth:`FeatureNet.attach`); its drafts may then differ slightly from those over the
dense weights, the target's output does not (it verifies every token).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from specpilot.drafters.base import DraftContext
from specpilot.drafters.expand import expand_spec
from specpilot.drafters.feature_net import FeatureNet
from specpilot.drafters.lean import lean_forward
from specpilot.errors import ContextLengthError, DrafterError
from specpilot.tree import DraftTree, GrowingTree, TreeSpec


class FeatureDrafter:
    """Owns a :class:`FeatureNet` and its K/V cache of committed entries (one sequence)."""

    name = "feature"

    def __init__(self, net: FeatureNet, max_len: int = 8192, min_prob: float = 0.0) -> None:
        """``min_prob``: draft nodes whose path probability under the drafter is below this are
        not expanded further (head: saves the forwards of unlikely depths; 0 = all)."""
        if not 0.0 <= min_prob < 1.0:
            raise DrafterError(f"drafter min_prob must be in [0, 1), got {min_prob}")
        self.min_logp = math.log(min_prob) if min_prob > 0 else -math.inf
        self.forwards = 0
        """Drafter forwards run so far (committed-token feeds and draft depths)."""
        if not net.attached:
            raise DrafterError("attach the target's embedding and LM head to the drafter first")
        net.eval()
        for p in net.parameters():
            p.requires_grad_(False)
        self.net = net
        self.cfg = net.cfg
        self.hidden_layers: tuple[int, ...] = tuple(net.cfg.taps)
        self.max_len = max_len
        self.vocab_ids = net.vocab_ids
        net.pack()
        self.lean = lean_forward(net)
        """The native-kernel forward of the draft layers (None: the module forward)."""
        net.rownorm = self.lean.norm if self.lean is not None else None
        self._k: list[Tensor] = []
        self._v: list[Tensor] = []
        self._m = 0
        """Committed entries cached (entry j holds target state j and token j+1)."""
        self._last: Tensor | None = None
        """(dim,) output state of the last committed entry."""

    # -- Drafter protocol ---------------------------------------------------------------------

    def begin(self, prompt: list[int]) -> None:
        self._m = 0
        self._last = None

    def finish(self, tokens: list[int]) -> None:
        """Nothing is kept across sequences."""

    # -- cache --------------------------------------------------------------------------------

    def _ensure(self, need: int) -> None:
        if need > self.max_len:
            raise ContextLengthError(
                f"trained drafter cache of {self.max_len} entries cannot hold {need}; "
                "raise its max_len"
            )
        cap = self._k[0].shape[2] if self._k else 0
        if need <= cap:
            return
        c = self.cfg
        size = min(self.max_len, max(need, 2 * cap, 256))
        dev, dt = self._where()
        shape = (1, c.n_kv_heads, size, c.head_dim)
        for lst in (self._k, self._v):
            old = list(lst)
            lst.clear()
            for i in range(c.n_layers):
                t = torch.zeros(shape, device=dev, dtype=dt)
                if old:
                    t[:, :, :cap] = old[i]
                lst.append(t)

    def _where(self) -> tuple[torch.device, torch.dtype]:
        """The drafter's own device and dtype (those of its weights)."""
        w = self.net.norm.weight
        return w.device, w.dtype

    def _run(self, x: Tensor, pos: Tensor, start: int, kv_len: int, mask: Tensor) -> Tensor:
        """Rows ``x`` (1, T, dim) at ``pos`` (1, T) -> cache slots ``start..``; outputs."""
        if self.lean is not None and not torch.is_grad_enabled():
            return self.lean.run(x, pos, self._k, self._v, start, kv_len, mask)
        t = x.shape[1]
        for i, layer in enumerate(self.net.layers):
            q, k, v = layer.kv(x, pos)
            self._k[i][:, :, start : start + t] = k
            self._v[i][:, :, start : start + t] = v
            x = layer.finish(
                x, q, self._k[i][:, :, :kv_len], self._v[i][:, :, :kv_len], mask.to(x.device)
            )
        return x

    def _feed_committed(self, ctx: DraftContext, scratch: int) -> Tensor:
        """Cache the entries of newly committed tokens; the last entry's output (dim,)."""
        tokens = ctx.tokens
        n = len(tokens)
        if not ctx.hidden or len(ctx.hidden) != len(self.hidden_layers):
            raise DrafterError(
                f"drafter {self.name!r} needs the target's hidden states of layers "
                f"{list(self.hidden_layers)}; run it through specpilot's Engine"
            )
        n_new = int(ctx.hidden[0].shape[0])
        start = n - 1 - n_new
        if start != self._m:
            raise DrafterError(
                f"drafter {self.name!r} expected hidden states from entry {self._m}, got them "
                f"from {start}; call begin() at the start of each sequence"
            )
        self._ensure(n - 1 + scratch)
        if n_new == 0 and self._last is not None:  # another tree at the same position
            return self._last
        dev, dt = self._where()
        taps = torch.stack([h.to(device=dev, dtype=dt) for h in ctx.hidden], dim=1)[None]
        nxt = torch.tensor([tokens[start + 1 : n]], device=dev)  # (1, n_new)
        x = self.net.entries(taps, nxt)  # (1, n_new, dim)
        self.forwards += 1
        pos = torch.arange(start, n - 1, device=dev)[None]
        rows = torch.arange(start, n - 1)[:, None]
        mask = (torch.arange(n - 1)[None, :] <= rows)[None]  # (1, n_new, n-1)
        out = self._run(x, pos, start, n - 1, mask)
        self._m = n - 1
        self._last = out[0, -1]
        return self._last

    def _log_probs(self, h: Tensor) -> Tensor:
        # h: (R, dim) -> (R, draft_vocab)
        return torch.log_softmax(self.net.logits(h).float(), dim=-1)

    def _map(self, tree: DraftTree) -> DraftTree:
        """Draft-vocabulary indices -> target token ids."""
        if tree.size == 0:
            return tree
        toks = self.vocab_ids.cpu()[tree.tokens]
        return DraftTree(toks, tree.parents, tree.depths, tree.scores)


class HeadDrafter(FeatureDrafter):
    """EAGLE-style head: one draft token per forward; chains, static and dynamic trees."""

    name = "head"

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftTree:
        spec: TreeSpec = ctx.spec
        scratch = spec.max_nodes if spec.kind != "dynamic" else spec.topk * spec.depth
        last = self._feed_committed(ctx, scratch)
        m = self._m
        outs: dict[int, Tensor] = {}
        fed = [0]

        def feed(nodes: GrowingTree, rows: list[int]) -> Tensor:
            dev = last.device
            t = len(rows)
            start = m + fed[0]
            kv_len = start + t
            mask = torch.zeros(1, t, kv_len, dtype=torch.bool)
            mask[0, :, :m] = True
            for r, i in enumerate(rows):
                p = nodes.parents[i]
                anc = ([] if p < 0 else nodes.states[p]) + [start + r]
                nodes.states[i] = anc
                mask[0, r, anc] = True
            g = torch.stack(
                [last if nodes.parents[i] < 0 else outs[nodes.parents[i]] for i in rows]
            )
            ids = self.vocab_ids[torch.tensor([nodes.tokens[i] for i in rows], device=dev)]
            x = self.net.step_input(g[None], ids[None])  # (1, t, dim)
            pos = torch.tensor([[m - 1 + nodes.depths[i] for i in rows]], device=dev)
            out = self._run(x, pos, start, kv_len, mask)[0]  # (t, dim)
            self.forwards += 1
            for r, i in enumerate(rows):
                outs[i] = out[r]
            fed[0] += t
            return self._log_probs(out)

        root = self._log_probs(last[None])[0]
        return self._map(expand_spec(root, feed, spec, self.min_logp))


def head_unroll(
    net: FeatureNet, taps: Tensor, tokens: Tensor, steps: int, keep: float = 1.0, seed: int = 0
) -> list[tuple[Tensor, Tensor]]:
    """Training forward with EAGLE-3's training-time test, unrolled ``steps`` deep.

    taps:   (B, T, n_taps, dim) target hidden states at positions 0..T-1
    tokens: (B, T) token ids
    Returns per step ``s`` the draft-vocabulary logits (B, k, V) of anchors ``j`` (k,) and the
    target positions ``j + 1 + s`` (k,) whose next-token distribution they should match: step s
    predicts token ``j+2+s`` after seeing the target's states up to ``j`` and the true tokens up
    to ``j+1+s`` (its own states stand in for the target's at depth > 1). Step-s rows attend to
    the step-0 entries 0..j and their own chain's rows of steps 1..s, as the drafter's nodes do
    at inference. ``keep`` < 1 computes logits for a random share of the anchors only (the LM
    head dominates the cost).
    """
    b, t = tokens.shape
    assert taps.shape[:2] == (b, t), (taps.shape, tokens.shape)
    n = t - 1
    dev = tokens.device
    g = net.feature(taps[:, :n])  # (B, n, dim)
    keys: list[list[tuple[Tensor, Tensor]]] = [[] for _ in net.layers]
    out: list[tuple[Tensor, Tensor]] = []
    for s in range(min(steps, n)):
        m = n - s  # anchors this step
        x = net.step_input(g[:, :m], tokens[:, 1 + s : 1 + s + m])
        pos = (torch.arange(m, device=dev) + s)[None].expand(b, m)
        mask = ttt_mask(n, s, dev)[None]  # (1, m, n + s*m)
        for i, layer in enumerate(net.layers):
            q, k, v = layer.kv(x, pos)
            keys[i].append((k, v))
            ks = [keys[i][0][0]] + [kk[:, :, :m] for kk, _ in keys[i][1:]]
            vs = [keys[i][0][1]] + [vv[:, :, :m] for _, vv in keys[i][1:]]
            x = layer.finish(x, q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), mask)
        rows = torch.arange(m, device=dev)
        if keep < 1.0:
            gen = torch.Generator().manual_seed(seed * 1009 + s)
            rows = torch.randperm(m, generator=gen)[: max(1, int(m * keep))].sort().values
            rows = rows.to(dev)
        out.append((net.logits(x[:, rows]), rows + 1 + s))
        g = x
    return out


def ttt_mask(n: int, s: int, device: torch.device | str = "cpu") -> Tensor:
    """(n - s, n + s * (n - s)) bool: which keys the step-``s`` rows of :func:`head_unroll` see.

    Columns are the ``n`` step-0 entries, then the rows of steps 1..s (``n - s`` each, by
    anchor). Anchor j sees entries 0..j and its own rows of steps 1..s (a diagonal per step).

    >>> ttt_mask(3, 1).int().tolist()
    [[1, 0, 0, 1, 0], [1, 1, 0, 0, 1]]
    """
    m = n - s
    causal = torch.arange(n, device=device)[None, :] <= torch.arange(m, device=device)[:, None]
    eye = torch.eye(m, dtype=torch.bool, device=device)
    return torch.cat([causal, *([eye] * s)], dim=1)
