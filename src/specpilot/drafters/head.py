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

Several sequences. Heads over one net draft together (:func:`propose_heads`, asked by
:func:`specpilot.drafters.base.propose_all` from the batched engine): the committed entries of
all in one forward, then each depth's frontier rows of every tree still growing in one forward
and one LM-head call (:func:`specpilot.tree.tree_steps` pauses each tree at every round). The
linears read their weights once per depth instead of once per sequence; attention runs per
sequence over its own cache (:meth:`~specpilot.drafters.lean.LeanForward.run_segments`). Four
HumanEval sequences' steady drafts (depth 3, two new entries each) took 3.4-3.6 ms together
against 6.3-6.5 ms one by one.

Native targets: the drafter reads the target's GGUF embedding and LM-head blocks in place, never an
fp32 copy (:meth:`FeatureNet.attach`); its drafts may then differ slightly from those over the
dense weights, the target's output does not (it verifies every token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from specpilot.drafters.base import DraftContext
from specpilot.drafters.expand import top_children
from specpilot.drafters.feature_net import FeatureNet
from specpilot.drafters.lean import Segment, lean_forward
from specpilot.errors import ContextLengthError, DrafterError
from specpilot.tree import Continuation, DraftTree, Request, TreeSpec, tree_steps


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
        return run_segments([self], x, pos, [Segment(start, kv_len, mask, x.shape[1])])

    def _module_run(self, x: Tensor, pos: Tensor, start: int, kv_len: int, mask: Tensor) -> Tensor:
        """:meth:`_run` through the module forward (training, or no native kernels)."""
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
        return feed_committed([self], [ctx], scratch)[0]

    def _new_entries(self, ctx: DraftContext, scratch: int) -> tuple[Tensor, Tensor, int] | None:
        """The tapped states (n_new, n_taps, dim) and next tokens (n_new,) of the entries
        committed since the last call, and the first one's index; None when there are none
        (another tree at the same position). Grows the cache for ``scratch`` draft rows."""
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
        if n_new == 0:
            if self._last is None:
                raise DrafterError(f"drafter {self.name!r} was asked before any entry")
            return None
        dev, dt = self._where()
        taps = torch.stack([h.to(device=dev, dtype=dt) for h in ctx.hidden], dim=1)
        nxt = torch.tensor(tokens[start + 1 : n], device=dev)
        return taps, nxt, start

    def _log_probs(self, h: Tensor) -> Tensor:
        # h: (R, dim) -> (R, draft_vocab)
        return torch.log_softmax(self.net.logits(h).float(), dim=-1)

    def _map(self, tree: DraftTree) -> DraftTree:
        """Draft-vocabulary indices -> target token ids."""
        if tree.size == 0:
            return tree
        toks = self.vocab_ids.cpu()[tree.tokens]
        return DraftTree(toks, tree.parents, tree.depths, tree.scores)


def run_segments(
    drafters: Sequence[FeatureDrafter], x: Tensor, pos: Tensor, segs: Sequence[Segment]
) -> Tensor:
    """Rows ``x`` (1, N, dim) at ``pos`` (1, N) of several sequences in one forward: segment
    ``j`` (``segs[j].rows`` consecutive rows) belongs to ``drafters[j]`` and goes to its cache
    (all share one net). The linears see all rows at once (the draft layers' weights are read
    once for the batch); each segment attends to its own cache. Returns (1, N, dim)."""
    d0 = drafters[0]
    if d0.lean is not None and not torch.is_grad_enabled():
        return d0.lean.run_segments(x, pos, [(d._k, d._v) for d in drafters], segs)
    outs, a = [], 0
    for d, seg in zip(drafters, segs, strict=True):
        b = a + seg.rows
        outs.append(d._module_run(x[:, a:b], pos[:, a:b], seg.start, seg.kv_len, seg.mask))
        a = b
    return torch.cat(outs, dim=1)


def feed_committed(
    drafters: Sequence[FeatureDrafter], ctxs: Sequence[DraftContext], scratch: int | Sequence[int]
) -> list[Tensor]:
    """Each drafter caches the entries of the tokens committed since its last call (one forward
    for all that have some); the output state (dim,) of each one's last entry. ``scratch``:
    draft rows to make room for after them (one count for all, or one each)."""
    scratch = [scratch] * len(drafters) if isinstance(scratch, int) else list(scratch)
    fed, parts, segs, poss = [], [], [], []
    for d, ctx, sc in zip(drafters, ctxs, scratch, strict=True):
        got = d._new_entries(ctx, sc)
        if got is None:
            continue
        taps, nxt, start = got
        n_new = nxt.shape[0]
        end = start + n_new
        rows = torch.arange(start, end)[:, None]
        mask = (torch.arange(end)[None, :] <= rows)[None]  # (1, n_new, end)
        fed.append(d)
        parts.append((taps, nxt))
        segs.append(Segment(start, end, mask, n_new))
        poss.append(torch.arange(start, end, device=taps.device))
    if fed:
        net = fed[0].net
        taps, nxt, pos = (_join(x) for x in ([t for t, _ in parts], [n for _, n in parts], poss))
        out = run_segments(fed, net.entries(taps, nxt), pos, segs)[0]
        end = 0
        for d, seg in zip(fed, segs, strict=True):
            end += seg.rows
            d.forwards += 1
            d._m = seg.kv_len
            d._last = out[end - 1]
    return [d._last for d in drafters]  # type: ignore[misc]


def _join(parts: list[Tensor]) -> Tensor:
    """The sequences' rows as one batch row: (1, N, ...)."""
    return (parts[0] if len(parts) == 1 else torch.cat(parts))[None]


class HeadDrafter(FeatureDrafter):
    """EAGLE-style head: one draft token per forward; chains, static and dynamic trees.

    Several heads over one net propose in lockstep (:func:`propose_heads`): each depth is one
    forward and one LM-head call for all of them."""

    name = "head"

    def batch_key(self) -> object:
        """Heads over the same net draft together (:func:`specpilot.drafters.base.propose_all`)."""
        return id(self.net)

    @staticmethod
    def propose_batch(drafters: Sequence[Any], ctxs: Sequence[DraftContext]) -> list[DraftTree]:
        return propose_heads(drafters, ctxs)

    def propose(self, ctx: DraftContext) -> DraftTree:
        return propose_heads([self], [ctx])[0]


class _Proposal:
    """One sequence of :func:`propose_heads`: its drafter, tree grower and fed draft rows."""

    def __init__(self, d: HeadDrafter, spec: TreeSpec, last: Tensor) -> None:
        self.d, self.spec, self.last = d, spec, last
        self.m = d._m
        self.fed = 0
        self.outs: dict[int, Tensor] = {}
        self.steps = tree_steps(spec, d.min_logp)
        self.req: Request | None = None
        self.tree = DraftTree.empty()

    def answer(self, kids: list[list[Continuation]] | None) -> None:
        """Send the children of the pending request (None: start); the next request or the
        finished tree."""
        try:
            self.req = next(self.steps) if kids is None else self.steps.send(kids)
        except StopIteration as stop:
            self.req = None
            self.tree = self.d._map(stop.value)

    def rows(self) -> tuple[Tensor, Tensor, Tensor, Segment]:
        """The pending request's frontier as draft rows: parent states (t, dim), draft-vocab
        token ids (t,), positions (t,) and the segment (cache slots after the fed ones, each
        row seeing the committed entries and its ancestors)."""
        assert self.req is not None
        nodes, rows, _ = self.req
        m, d = self.m, self.d
        t = len(rows)
        start = m + self.fed
        kv_len = start + t
        mask = torch.zeros(1, t, kv_len, dtype=torch.bool)
        mask[0, :, :m] = True
        for r, i in enumerate(rows):
            p = nodes.parents[i]
            anc = ([] if p < 0 else nodes.states[p]) + [start + r]
            nodes.states[i] = anc
            mask[0, r, anc] = True
        g = torch.stack([self.last if nodes.parents[i] < 0 else self.outs[nodes.parents[i]]
                         for i in rows])  # fmt: skip
        dev = self.last.device
        ids = d.vocab_ids[torch.tensor([nodes.tokens[i] for i in rows], device=dev)]
        pos = torch.tensor([m - 1 + nodes.depths[i] for i in rows], device=dev)
        self.fed += t
        return g, ids, pos, Segment(start, kv_len, mask, t)

    def keep(self, out: Tensor) -> None:
        """The draft rows' outputs (t, dim) of the pending request (their children's input)."""
        assert self.req is not None
        for r, i in enumerate(self.req[1]):
            self.outs[i] = out[r]


@torch.no_grad()
def propose_heads(drafters: Sequence[HeadDrafter], ctxs: Sequence[DraftContext]) -> list[DraftTree]:
    """Each head's tree for its context, the heads' forwards batched: one forward for the
    committed entries of all, then per depth one forward and one LM-head call for the frontier
    rows of every tree still growing (the draft layers' and the LM head's weights are read once
    per depth, not once per sequence). All share one net; each keeps its own cache, and a
    sequence's tree does not depend on the others' when the net's linears are batch-invariant
    (the native kernels)."""
    if not drafters:
        return []
    net = drafters[0].net
    if any(d.net is not net for d in drafters):
        raise DrafterError("heads drafting together must share one net")
    specs = [c.spec for c in ctxs]
    scratch = [s.max_nodes if s.kind != "dynamic" else s.topk * s.depth for s in specs]
    lasts = feed_committed(drafters, ctxs, scratch)
    root = drafters[0]._log_probs(torch.stack(lasts))  # (B, V)
    props = [_Proposal(d, s, last) for d, s, last in zip(drafters, specs, lasts, strict=True)]
    for j, p in enumerate(props):
        p.answer(None)
        if p.req is not None:  # the root's children
            p.answer(top_children(root[j : j + 1], p.req[2], p.spec.kind != "dynamic"))
    while True:
        live = [p for p in props if p.req is not None]
        if not live:
            break
        got = [p.rows() for p in live]
        g, ids, pos = (_join([r[i] for r in got]) for i in range(3))
        x = net.step_input(g, ids)  # (1, N, dim)
        out = run_segments([p.d for p in live], x, pos, [r[3] for r in got])[0]
        lp = drafters[0]._log_probs(out)  # (N, V)
        a = 0
        for p, r in zip(live, got, strict=True):
            b = a + r[3].rows
            p.d.forwards += 1
            p.keep(out[a:b])
            p.answer(top_children(lp[a:b], p.req[2], p.spec.kind != "dynamic"))  # type: ignore[index]
            a = b
    return [p.tree for p in props]


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
