"""Batch-invariant fp32 attention (``specpilot::attention``) and one layer's RoPE + KV-cache
write + attention in one call (``specpilot::rope_attention``): the Python face of the C++ ops.

The order of the arithmetic is the attention contract in the package docstring: each output
row (b, h, t) depends on its query, the keys and values its mask row lets it see, and nothing
else, with the same bits for every query count, batch, thread count and ISA path. The ISA path
follows :func:`specpilot.kernels.linear.isa_code` (``$SPECPILOT_KERNELS_ISA``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specpilot.kernels import build
from specpilot.kernels.linear import isa_code


def _register_fakes() -> None:
    @torch.library.register_fake("specpilot::attention")
    def _(q, k, v, kv_len, mask, scale, isa=0):  # type: ignore[no-untyped-def]
        b, h, t, hd = q.shape
        return q.new_empty((b, t, h, hd)).transpose(1, 2)

    @torch.library.register_fake("specpilot::rope_attention")
    def _(qkv, cos, sin, q_norm, k_norm, eps, offset, k_cache, v_cache, cache_row, batch, slots,
          slot0, kv_len, mask, scale, n_q, n_k, head_dim, isa=0):  # type: ignore[no-untyped-def]  # fmt: skip
        return qkv.new_empty((*qkv.shape[:-1], n_q * head_dim))

    @torch.library.register_fake("specpilot::fixed_exp")
    def _(x, isa=0):  # type: ignore[no-untyped-def]
        return torch.empty_like(x)


def ops() -> Any:
    """``torch.ops.specpilot`` with the attention ops' fake kernels registered (else
    RuntimeError with the one-line reason the kernels are unavailable)."""
    return build.ops("attention", _register_fakes)


def fixed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_len: int,
    mask: Tensor | None = None,
    scale: float | None = None,
    isa: str | None = None,
) -> Tensor:
    """Softmax attention of ``q`` (B, H, T, hd) over keys/values ``k``, ``v`` (B, Hk, >= kv_len,
    hd), all fp32 (H a multiple of Hk: query head h reads kv head h // (H / Hk)).

    ``mask``: (B or 1, T, kv_len) bool, True = may attend; None = every row sees all kv_len
    keys. ``scale``: None = 1/sqrt(hd). Returns (B, H, T, hd) fp32 (laid out as (B, T, H, hd),
    so ``out.transpose(1, 2)`` is contiguous); a row that sees no key is zeros.
    """
    s = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return ops().attention(q, k, v, int(kv_len), mask, s, isa_code(isa))


def rope_attention(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: int | Tensor,
    kv_len: int,
    mask: Tensor | None,
    n_q: int,
    n_k: int,
    head_dim: int,
    batch: int = 1,
    cache_row: int = 0,
    scale: float | None = None,
    norms: tuple[Tensor, Tensor, float, bool] | None = None,
    isa: str | None = None,
) -> Tensor:
    """One layer's attention from its fused q/k/v projection ``qkv`` (``batch`` x T rows of
    ``(n_q + 2 n_k) * head_dim``: q, k, v heads): RoPE on q and k (``cos``/``sin``: a row's
    (head_dim) tables; ``norms`` = (q norm weight, k norm weight, eps, offset) RMS-norms each
    head first), the rotated k and the v heads written to cache rows ``cache_row + b`` of
    ``k_cache``/``v_cache`` (B, n_k, len, head_dim) at ``slots`` (an int: contiguous from it,
    (T,) or (B, T) long), then :func:`fixed_attention` of the q heads over slots [0, kv_len).
    The same bits as :func:`specpilot.kernels.rowops.rope_qk`, the cache writes and
    :func:`fixed_attention` in turn. Returns qkv's leading shape x (n_q * head_dim)."""
    s = head_dim**-0.5 if scale is None else float(scale)
    qw, kw, eps, offset = (None, None, 1e-6, False) if norms is None else norms
    tab, start = (None, int(slots)) if isinstance(slots, int) else (slots, 0)
    return ops().rope_attention(
        qkv, cos, sin, qw, kw, float(eps), bool(offset), k_cache, v_cache, int(cache_row),
        int(batch), tab, start, int(kv_len), mask, s, int(n_q), int(n_k), int(head_dim),
        isa_code(isa),
    )  # fmt: skip


def fixed_exp(x: Tensor, isa: str | None = None) -> Tensor:
    """The contract's exp on fp32 (the one both ISA paths use inside the attention)."""
    return ops().fixed_exp(x, isa_code(isa))
