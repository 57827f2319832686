"""The trained drafters' inference forward on the native kernels: each draft layer as a flat
sequence of op calls, as the target's lean forward (:mod:`specpilot.kernels.step`).

The module forward (:class:`~specpilot.drafters.feature_net.DraftLayer`) is written for training:
nn.RMSNorm, RoPE in ~10 torch ops a call, SDPA over cache slices, the residual adds apart. At
drafting sizes (1-16 rows, one layer of dim 576) that glue cost about as much as the weights: a
head forward of SmolLM2's drafter took ~1.1 ms of which the packed linears were ~0.3. Here one
layer is the input norm (``specpilot::rms_norm``), the packed q/k/v projection,
``specpilot::rope_attention`` (RoPE, the write of the rows' K/V into the drafter's cache at
``start..`` and the attention under the drafter's mask, in one op), o_proj,
``specpilot::add_rms_norm`` (the residual add and the post-attention norm), gate_up,
``specpilot::glu`` and down.

The numbers differ from the module forward's in the last bits (the kernels' fixed reduction
order and exp instead of oneDNN's and torch's): drafts may differ very slightly, the output
cannot (the target verifies every token). Used only without autograd, on CPU fp32 weights with
the kernels built and every linear packed (:meth:`FeatureNet.pack`); training and every other
setup keep the module forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from specpilot import kernels
from specpilot.drafters.feature_net import FeatureNet, fast_linear

__all__ = ["LeanForward", "Segment", "lean_forward"]


class Segment(NamedTuple):
    """One sequence's rows in a batched draft forward (:meth:`LeanForward.run_segments`)."""

    start: int
    """Cache slot of the first row."""
    kv_len: int
    """The rows attend to cache slots [0, kv_len)."""
    mask: Tensor
    """(1, rows, kv_len) bool: which of those slots each row sees."""
    rows: int


class LeanForward:
    """The draft layers, norms and RoPE tables of one :class:`FeatureNet` on the native ops."""

    def __init__(self, net: FeatureNet) -> None:
        from specpilot.kernels import rowops
        from specpilot.kernels.attention import ops as attention_ops
        from specpilot.kernels.linear import isa_code

        c = net.cfg
        self.net = net
        self.heads = (c.n_heads, c.n_kv_heads, c.head_dim)
        self.eps = float(c.rms_eps)
        self.scale = c.head_dim**-0.5
        ro = rowops.ops()
        self._rms, self._add_rms, self._glu = (
            ro.rms_norm.default,
            ro.add_rms_norm.default,
            ro.glu.default,
        )
        self._attend = attention_ops().rope_attention.default
        self.isa = isa_code()
        self._inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
        )
        self._cos = torch.empty(0, c.head_dim)
        self._sin = torch.empty(0, c.head_dim)

    def norm(self, x: Tensor, w: Tensor) -> Tensor:
        """RMSNorm of the rows of ``x`` with weight ``w`` (the net's eps)."""
        return self._rms(x.contiguous(), w, self.eps, False, self.isa)  # type: ignore[no-any-return]

    def _tables(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin (rows, head_dim) at positions ``pos`` (rotate-half layout, as
        :func:`~specpilot.drafters.feature_net.rope`)."""
        need = int(pos.max()) + 1
        if need > self._cos.shape[0]:
            n = max(need, 2 * self._cos.shape[0], 256)
            freqs = torch.arange(n, dtype=torch.float32)[:, None] * self._inv_freq[None]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos(), emb.sin()
        flat = pos.reshape(-1)
        return self._cos[flat], self._sin[flat]

    def run_segments(self, x: Tensor, pos: Tensor, caches: Sequence[tuple[list[Tensor],
                     list[Tensor]]], segs: Sequence[Segment]) -> Tensor:  # fmt: skip
        """Rows ``x`` (1, N, dim) at ``pos`` (1, N) through every draft layer, in segments:
        segment ``j`` is ``segs[j].rows`` consecutive rows of one sequence whose cache is
        ``caches[j]`` (per layer K and V, (1, Hk, len, hd)). Each layer's K/V of a segment's
        rows go to its cache at slots ``start..start + rows - 1``; the rows attend to slots
        ``[0, kv_len)`` under ``mask`` (1, rows, kv_len) bool. The norms and linears take all
        rows at once, the attention one call per segment. Returns the last layer's output
        (1, N, dim)."""
        h, hk, hd = self.heads
        eps, isa = self.eps, self.isa
        cos, sin = self._tables(pos)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        bounds = []
        a = 0
        for seg in segs:
            bounds.append((a, a + seg.rows))
            a += seg.rows
        masks = [seg.mask.contiguous() for seg in segs]
        for i, layer in enumerate(self.net.layers):
            a_ = self._rms(rows, layer.norm1.weight, eps, False, isa)
            qkv = fast_linear(layer, "qkv", a_)
            parts = []
            for (lo, hi), seg, mask, (ks, vs) in zip(bounds, segs, masks, caches, strict=True):
                one = len(segs) == 1
                parts.append(self._attend(
                    qkv if one else qkv[lo:hi], cos if one else cos[lo:hi],
                    sin if one else sin[lo:hi], None, None, eps, False, ks[i], vs[i], 0, 1,
                    None, seg.start, seg.kv_len, mask, self.scale, h, hk, hd, isa))  # fmt: skip
            o = parts[0] if len(parts) == 1 else torch.cat(parts)
            mid, a_ = self._add_rms(fast_linear(layer, "o", o), rows, layer.norm2.weight, eps,
                                    False, isa)  # fmt: skip
            act = self._glu(fast_linear(layer, "gate_up", a_), None, 0, isa)
            rows = mid + fast_linear(layer, "down", act)
        return rows.view(x.shape)


def lean_forward(net: FeatureNet) -> LeanForward | None:
    """A :class:`LeanForward` for ``net`` where it can run (CPU fp32 weights, the native kernels
    built, every draft-layer linear packed by :meth:`FeatureNet.pack`, a head dimension the
    attention kernel takes), else None (the module forward)."""
    c = net.cfg
    w = net.norm.weight
    if w.device.type != "cpu" or w.dtype != torch.float32 or kernels.unavailable_reason():
        return None
    if c.head_dim % 2 or c.head_dim > 1024 or c.n_heads % c.n_kv_heads or math.isnan(c.rope_theta):
        return None
    for layer in net.layers:
        fast: dict[str, Any] = getattr(layer, "fast", {})
        if any(name not in fast for name in ("qkv", "o", "gate_up", "down")):
            return None
    return LeanForward(net)
