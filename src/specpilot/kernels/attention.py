"""Batch-invariant fp32 attention (``specpilot::attention``): the Python face of the C++ op.

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


def fixed_exp(x: Tensor, isa: str | None = None) -> Tensor:
    """The contract's exp on fp32 (the one both ISA paths use inside the attention)."""
    return ops().fixed_exp(x, isa_code(isa))
